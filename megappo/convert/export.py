"""Megatron -> Hugging Face tensors: THE one code path, used by `convert mcore-to-hf` and the trainer's weight sync.

`iter_hf_weights(model_chunks, parallel_state, hf_config)` walks every parameter of the global model in a fixed
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

from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from megappo.convert.hf_to_mcore import local_params, model_role
from megappo.convert.mapping import ParamMap, merge_to_hf, model_spec_from_hf_config, param_maps
from megappo.parallel import ParallelState

Bucket = list[tuple[str, torch.Tensor]]  # (hf_name, full tensor) pairs


@dataclass
class _Meta:
    shape: tuple[int, ...]  # this rank's shard shape (same on the owner's TP/EP peers)
    dtype: torch.dtype


def _size(group: Any) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def _gather_owners(mine: dict[str, _Meta], group: Any) -> dict[str, tuple[int, _Meta]]:
    """canonical name -> (group rank of the pipeline stage holding it, metadata), agreed by every rank."""
    if _size(group) == 1:
        return {n: (0, m) for n, m in mine.items()}
    gathered: list[Any] = [None] * _size(group)
    dist.all_gather_object(gathered, mine, group=group)
    owners: dict[str, tuple[int, _Meta]] = {}
    for r, metas in enumerate(gathered):
        for n, m in metas.items():
            owners.setdefault(n, (r, m))  # tied embedding copies: the first stage's wins
    return owners


def _broadcast(t: Optional[torch.Tensor], meta: _Meta, src: int, group: Any, device: torch.device) -> torch.Tensor:
    """Broadcast `t` from group rank `src`; other ranks pass None and get a new tensor of `meta`."""
    if _size(group) == 1:
        return t
    if t is None:
        t = torch.empty(meta.shape, dtype=meta.dtype, device=device)
    dist.broadcast(t, src=dist.get_global_rank(group, src), group=group)
    return t


def _all_gather(t: torch.Tensor, group: Any) -> list[torch.Tensor]:
    n = _size(group)
    if n == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _expert_index(canonical: str) -> int:
    return int(canonical.split(".local_experts.")[1].split(".")[0])


@torch.no_grad()
def iter_hf_weights(model_chunks: list[nn.Module], parallel_state: ParallelState, hf_config: Any, *,
                    bucket_bytes: int = 512 << 20, role: Optional[str] = None,
                    dtype: Optional[torch.dtype] = None, copy: bool = True,
                    only_adapted: bool = False) -> Iterator[Bucket]:
    """Yield buckets (lists of (hf_name, full tensor)) of about `bucket_bytes` covering the whole model.

    hf_config: the HF config (dict or transformers config) the model was built from. role: None reads the chunks'
    `megappo_role`; critic/reward yield the value head as `score.weight` and no `lm_head`. dtype: cast each tensor.
    Collective: every rank of the world calls it with the same arguments; see the module docstring for which
    groups are used. Tensors are on the parameters' device; fresh copies (safe to keep) unless `copy=False`, which
    may yield views of the parameters, valid until they next change (module docstring).

    A LoRA model (`megappo.models.lora`) yields its merged weights (W + scaling * B A; adapters that are off
    leave W); `only_adapted` yields only the adapted layers' weights, the ones a LoRA step changes (every rank
    must pass the same value).
    """
    from megappo.models.vlm.config import is_vlm_config  # VLM hook (issue 26): megappo.convert.qwen2_vl

    if is_vlm_config(hf_config):
        from megappo.convert.qwen2_vl import iter_hf_vlm_weights

        yield from iter_hf_vlm_weights(model_chunks, parallel_state, hf_config, bucket_bytes=bucket_bytes, role=role,
                                       dtype=dtype, copy=copy)
        return
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

    owners = _gather_owners({slot_key(n): _Meta(tuple(lp.param.shape), lp.param.dtype) for n, lp in mine.items()},
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
                shard_list = _all_gather(shard, ps.expert_tp_group if pm.expert else ps.tp_group)
            else:
                shard_list = [shard]
            yield hf_tensors(merge_to_hf(pm, spec, shard_list), shard_list, dtype, copy)

    yield from bucketed(groups(), bucket_bytes)


def hf_tensors(pairs, shards: list[torch.Tensor], dtype: Optional[torch.dtype], copy: bool) -> Bucket:
    """One parameter's merged HF tensors in `dtype`; with `copy`, never a view of a shard (a kept tensor must not
    change with the parameter it came from)."""
    out: Bucket = []
    for name, full in pairs:
        full = full.to(dtype) if dtype is not None else full
        if copy and any(_same_storage(full, s) for s in shards):
            full = full.clone()
        out.append((name, full))
    return out


def bucketed(groups: Iterable[Bucket], bucket_bytes: int) -> Iterator[Bucket]:
    """Buckets of about `bucket_bytes` from groups (one parameter's HF tensors, never split across buckets), lazily:
    each group is produced (collectively) only when the consumer asks for the next bucket."""
    bucket: Bucket = []
    nbytes = 0
    for group in groups:
        bucket.extend(group)
        nbytes += sum(t.numel() * t.element_size() for _, t in group)
        if nbytes >= bucket_bytes:
            yield bucket
            bucket, nbytes = [], 0
    if bucket:
        yield bucket


def _fetch(pm: ParamMap, mine: dict, meta: _Meta, src_stage: int, num_local: int, ps: Any,
           device: torch.device) -> torch.Tensor:
    """This rank's TP shard of `pm`, brought from the owning EP rank (experts) and pipeline stage."""
    on_owner_stage = ps.pp_rank == src_stage if _size(ps.pp_group) > 1 else True
    local = mine.get(pm.mcore)
    # Off the owning stage a local copy (the last stage's tied output layer) must not be overwritten by the receive.
    t = local.param.data if local is not None and on_owner_stage else None
    if pm.expert and _size(ps.ep_group) > 1 and on_owner_stage:
        t = _broadcast(t, meta, _expert_index(pm.mcore) // num_local, ps.ep_group, device)
    return _broadcast(t, meta, src_stage, ps.pp_group, device)


def hf_state_dict(model_chunks: list[nn.Module], parallel_state: ParallelState, hf_config: Any, **kw: Any) -> dict:
    """All of `iter_hf_weights` in one dict (small models and tests only: it holds the whole model)."""
    return {name: t for bucket in iter_hf_weights(model_chunks, parallel_state, hf_config, **kw) for name, t in bucket}
