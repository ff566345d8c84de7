"""Megatron -> Hugging Face tensors: THE one code path, used by `convert mcore-to-hf` and the trainer's weight sync.

`megappo.kinds.weights.iter_hf_weights(model_chunks, parallel_state, hf_config)` asks the model's kind; for a
text model that is `iter_gpt_weights` here, which walks every parameter of the global model in a fixed
order (embedding, layers 0..L-1, final norm, head) and yields buckets of (hf_name, full tensor):
1. pipeline: the stage owning the parameter broadcasts this rank's shard over `pp_group` (every stage receives);
2. experts: on the owning stage, the expert-parallel rank holding expert e broadcasts it over `ep_group`, before
   step 1, so that every EP rank has the global expert (HF names carry the global expert index);
3. tensor parallel: shards are all-gathered over `tp_group` (`expert_tp_group` for experts) and merged back into
   HF tensors (qkv split per query group into q/k/v, fc1 into gate/up, vocab padding dropped).

Every rank of the world must call it, and every rank receives every full tensor (data-parallel replicas each run
their own, identical collectives). That is what a weight sync needs (each rollout engine shard reads the names it
holds); a file writer keeps rank 0's and drops the rest as it goes. Peak extra memory per rank: one bucket.

The tensors are fresh copies by default, safe to keep (`convert mcore-to-hf`, anything that holds them). With
`copy=False` a tensor may instead be a view of a parameter's own storage (a TP-1 parameter as it is, a fused GLU
half, a vocabulary slice): no copy is made where HF's layout allows none, and the tensor changes with the next
optimizer step. That is for a consumer that copies each bucket away before the model changes again: the in-process
engine's `copy_` into its parameters, the SGLang staging buffers, a broadcast. Such a view must not be written to.
"""
from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
from torch import nn

from megappo.convert.collectives import (
    Bucket, Meta, all_gather, broadcast_from, bucketed, gather_owners, group_size, hf_tensors,
)
from megappo.convert.mapping import ParamMap, merge_to_hf, model_spec_from_hf_config, param_maps
from megappo.convert.params import local_params, model_role
from megappo.parallel import ParallelState


def _expert_index(canonical: str) -> int:
    return int(canonical.split(".local_experts.")[1].split(".")[0])


@torch.no_grad()
def iter_gpt_weights(model_chunks: list[nn.Module], parallel_state: ParallelState, hf_config: Any, *,
                     bucket_bytes: int = 512 << 20, role: Optional[str] = None,
                     dtype: Optional[torch.dtype] = None, copy: bool = True, only_adapted: bool = False,
                     language_model_only: bool = False) -> Iterator[Bucket]:
    """`megappo.kinds.weights.iter_hf_weights` of the text families (all of which is language model)."""
    spec = model_spec_from_hf_config(hf_config)
    role = role or model_role(model_chunks)
    ordered = param_maps(spec, role)
    maps = {pm.mcore: pm for pm in ordered}
    if only_adapted:
        from megappo.models.lora import adapted_weight_filter

        adapted = adapted_weight_filter(model_chunks)
        ordered = [pm for pm in ordered if adapted(pm.mcore)]
    ps = parallel_state
    mine = {lp.canonical: lp for lp in local_params(model_chunks, spec, ps, maps, merge_lora=True)}
    device = next(iter(mine.values())).param.device if mine else torch.device("cpu")
    num_local = spec.num_experts // ps.ep_size if spec.num_experts else 0

    # Experts: on the owning stage only EP rank e // num_local holds expert e; name them by expert slot (expert
    # index mod num_local) so every EP rank reports the same key set and the owner lookup is layout-independent.
    def slot_key(name: str) -> str:
        if ".local_experts." not in name:
            return name
        e = _expert_index(name)
        return name.replace(f".local_experts.{e}.", f".local_experts.slot{e % num_local}.")

    owners = gather_owners({slot_key(n): Meta(tuple(lp.param.shape), lp.param.dtype) for n, lp in mine.items()},
                           ps.pp_group)

    def groups() -> Iterator[Bucket]:
        for pm in ordered:
            key = slot_key(pm.mcore)
            if key not in owners:
                raise RuntimeError(f"no pipeline stage holds {pm.mcore}; the model chunks do not cover the model "
                                   f"described by hf_config (role {role})")
            src_stage, meta = owners[key]
            shard = _fetch(pm, mine, meta, src_stage, num_local, ps, device)
            if pm.tp_dim is not None:
                shard_list = all_gather(shard, ps.expert_tp_group if pm.expert else ps.tp_group)
            else:
                shard_list = [shard]
            yield hf_tensors(merge_to_hf(pm, spec, shard_list), shard_list, dtype, copy)

    yield from bucketed(groups(), bucket_bytes)


def _fetch(pm: ParamMap, mine: dict, meta: Meta, src_stage: int, num_local: int, ps: Any,
           device: torch.device) -> torch.Tensor:
    """This rank's TP shard of `pm`, brought from the owning EP rank (experts) and pipeline stage."""
    on_owner_stage = ps.pp_rank == src_stage if group_size(ps.pp_group) > 1 else True
    local = mine.get(pm.mcore)
    # Off the owning stage a local copy (the last stage's tied output layer) must not be overwritten by the receive.
    t = local.param.data if local is not None and on_owner_stage else None
    if pm.expert and group_size(ps.ep_group) > 1 and on_owner_stage:
        t = broadcast_from(t, meta, _expert_index(pm.mcore) // num_local, ps.ep_group, device)
    return broadcast_from(t, meta, src_stage, ps.pp_group, device)
