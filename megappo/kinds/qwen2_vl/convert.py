"""Qwen2.5-VL / Qwen2-VL <-> megatron (`megappo.kinds.qwen2_vl.model`): the name/tensor mapping, streaming load and
export.

HF names are those of the released checkpoints, which transformers 5 still writes (`model.layers.*`, `visual.*`,
`lm_head.weight`); transformers 5's in-memory names (`model.language_model.*`, `model.visual.*`) are read too.
The language model is a qwen2 decoder: its ParamMaps are `megappo.convert.mapping.param_maps` of the text config
with `language_model.` before the megatron name. The vision tower adds (megatron `vision_model.*`, every tensor on
the first pipeline stage):
- `vqkv`: HF's fused qkv rows are [3, heads, head_dim]; megatron's linear_qkv (one query per group) wants
  [heads, 3, head_dim] so that TP splits whole heads. Split over TP by heads.
- the SwiGLU fc1 is [gate; up] (`glu`, as the LM's), fc2 / proj split by columns; RowParallel biases whole.
- merger: ln_q, then `merger.projection.encoder.linear_fc{1,2}` = HF `merger.mlp.{0,2}`.

`load_hf_vlm_weights` / `iter_hf_vlm_weights` are this kind's `hf_to_mcore.load_hf_weights` /
`export.iter_hf_weights` (each rank reads only its own rows; export broadcasts from the owning stage and all-gathers
TP shards).
"""
from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
from torch import nn

from megappo.convert.collectives import Meta, all_gather, broadcast_from, bucketed, gather_owners, hf_tensors
from megappo.convert.mapping import (
    VALUE_HEAD, ConversionError, ModelSpec, ParamMap, canonical_name, merge_to_hf, model_spec_from_hf_config,
    param_maps, shard_from_hf,
)
from megappo.convert.params import check_all_used, model_role, not_a_parameter
from megappo.kinds.qwen2_vl.config import read_vlm_config
from megappo.models.builder import unwrap
from megappo.models.lora.layers import NO_ADAPTERS

LM_PREFIX, VISION_PREFIX = "language_model.", "vision_model."
_HF_VISION = "visual."
# the checkpoint's prefix -> transformers 5's in-memory spelling of the same tensors, also accepted on load
_ALIASES = (("model.", "model.language_model."), ("visual.", "model.visual."))


def vision_param_maps(args) -> list[ParamMap]:
    """The vision tower's ParamMaps (megatron names under `vision_model.`), in export order."""
    v, hv, mv = args.vision, _HF_VISION, VISION_PREFIX
    layer_norm = v.norm == "LayerNorm"  # Qwen2-VL's norms have biases

    def norm(mc: str, hf: str) -> list[ParamMap]:
        out = [ParamMap(f"{mc}.weight", (f"{hf}.weight",), "copy", None)]
        return out + ([ParamMap(f"{mc}.bias", (f"{hf}.bias",), "copy", None)] if layer_norm else [])

    maps = [ParamMap(f"{mv}patch_embed.proj.weight", (f"{hv}patch_embed.proj.weight",), "copy", None)]
    for i in range(v.depth):
        mc, hf = f"{mv}blocks.{i}", f"{hv}blocks.{i}"
        maps += norm(f"{mc}.input_layernorm", f"{hf}.norm1")
        for t in ("weight", "bias"):
            maps.append(ParamMap(f"{mc}.self_attention.linear_qkv.{t}", (f"{hf}.attn.qkv.{t}",), "vqkv", 0))
        maps += [ParamMap(f"{mc}.self_attention.linear_proj.weight", (f"{hf}.attn.proj.weight",), "copy", 1),
                 ParamMap(f"{mc}.self_attention.linear_proj.bias", (f"{hf}.attn.proj.bias",), "copy", None)]
        maps += norm(f"{mc}.pre_mlp_layernorm", f"{hf}.norm2")
        if v.gated_mlp:
            for t in ("weight", "bias"):
                maps.append(ParamMap(f"{mc}.mlp.linear_fc1.{t}", (f"{hf}.mlp.gate_proj.{t}", f"{hf}.mlp.up_proj.{t}"),
                                     "glu", 0))
            down = f"{hf}.mlp.down_proj"
        else:
            maps += [ParamMap(f"{mc}.mlp.linear_fc1.{t}", (f"{hf}.mlp.fc1.{t}",), "copy", 0) for t in ("weight", "bias")]
            down = f"{hf}.mlp.fc2"
        maps += [ParamMap(f"{mc}.mlp.linear_fc2.weight", (f"{down}.weight",), "copy", 1),
                 ParamMap(f"{mc}.mlp.linear_fc2.bias", (f"{down}.bias",), "copy", None)]
    maps += norm(f"{mv}merger.ln_q", f"{hv}merger.ln_q")
    enc = f"{mv}merger.projection.encoder"
    maps += [ParamMap(f"{enc}.linear_fc1.weight", (f"{hv}merger.mlp.0.weight",), "copy", 0),
             ParamMap(f"{enc}.linear_fc1.bias", (f"{hv}merger.mlp.0.bias",), "copy", 0),
             ParamMap(f"{enc}.linear_fc2.weight", (f"{hv}merger.mlp.2.weight",), "copy", 1),
             ParamMap(f"{enc}.linear_fc2.bias", (f"{hv}merger.mlp.2.bias",), "copy", None)]
    return maps


def vlm_param_maps(hf_config: Any, role: str = "actor"):
    """(text ModelSpec, VLMArgs, ParamMaps): vision tower first, then the language model, in export order."""
    args = read_vlm_config(hf_config)
    spec = model_spec_from_hf_config(args.text_config)
    lm = [ParamMap(LM_PREFIX + pm.mcore, pm.hf, pm.kind, pm.tp_dim, pm.expert, pm.layer)
          for pm in param_maps(spec, role)]
    return spec, args, vision_param_maps(args) + lm


def language_model_spec(hf_config: Any, source: Optional[str] = None) -> ModelSpec:
    """The conversion's ModelSpec of the language model (`source`: the config's path, for error messages)."""
    return model_spec_from_hf_config(read_vlm_config(hf_config).text_config, source)


# -- tensor arithmetic of the vision qkv ---------------------------------------------------------------------------
def _vqkv_shard(full: torch.Tensor, heads: int, rank: int, size: int) -> torch.Tensor:
    rest = full.shape[1:]
    per_head = full.reshape(3, heads, -1, *rest).transpose(0, 1)  # [heads, 3, head_dim, ...]
    n = heads // size
    return per_head[rank * n:(rank + 1) * n].reshape(-1, *rest).contiguous()


def _vqkv_merge(shards: list[torch.Tensor], heads: int) -> torch.Tensor:
    full = torch.cat(shards, dim=0)
    rest = full.shape[1:]
    return full.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(-1, *rest).contiguous()


def shard_for(pm: ParamMap, spec, args, read, rank: int, size: int, local_shape) -> torch.Tensor:
    if pm.kind == "vqkv":
        out = _vqkv_shard(read(pm.hf[0], None, 0, 0), args.vision.num_heads, rank, size)
        if tuple(out.shape) != tuple(local_shape):
            raise ConversionError(f"{pm.mcore}: HF {pm.hf[0]} gives {tuple(out.shape)} at TP rank {rank}/{size}, the "
                                  f"megatron parameter is {tuple(local_shape)}; the checkpoint does not match its config")
        return out
    return shard_from_hf(pm, spec, read, rank, size, tuple(local_shape))


def merge_for(pm: ParamMap, spec, args, shards: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    if pm.kind == "vqkv":
        return [(pm.hf[0], _vqkv_merge(shards, args.vision.num_heads))]
    return merge_to_hf(pm, spec, shards)


# -- this rank's parameters under canonical names ------------------------------------------------------------------
def vlm_local_params(model_chunks: list[nn.Module], spec, maps: dict[str, ParamMap], parallel_state):
    """[(canonical name, parameter, tp_rank, tp_size)] of this rank; raises ConversionError for an unknown one."""
    out = []
    for chunk in model_chunks:
        m = unwrap(chunk)
        layers = [layer.layer_number for layer in m.language_model.decoder.layers]
        for local, p in m.named_parameters():
            if local.startswith(LM_PREFIX):
                name = LM_PREFIX + canonical_name(local[len(LM_PREFIX):], layers, 0)
                if name == LM_PREFIX + "output_layer.weight" and spec.tied_embeddings and name not in maps:
                    name = LM_PREFIX + "embedding.word_embeddings.weight"
            else:
                name = local
            pm = maps.get(name)
            if pm is None:
                raise ConversionError(f"megatron parameter {local!r} (shape {tuple(p.shape)}) has no Hugging Face "
                                      f"counterpart; the model was built from a different config")
            tp = (0, 1) if pm.tp_dim is None else (parallel_state.tp_rank, parallel_state.tp_size)
            out.append((name, p, *tp))
    return out


class _Reader:
    """HFCheckpoint.read under the checkpoint names, also for files written with transformers 5's in-memory names."""

    def __init__(self, ckpt):
        self.ckpt = ckpt
        self.used: set[str] = set()

    def resolve(self, name: str) -> str:
        if name in self.ckpt.files:
            return name
        for ours, alias in _ALIASES:
            if name.startswith(ours) and alias + name[len(ours):] in self.ckpt.files:
                return alias + name[len(ours):]
        self.ckpt.require(name, "a megatron parameter")
        return name

    def __call__(self, name: str, dim: Optional[int], start: int, stop: int) -> torch.Tensor:
        real = self.resolve(name)
        self.used.add(real)
        return self.ckpt.read(real, dim, start, stop)


@torch.no_grad()
def load_hf_vlm_weights(model_chunks: list[nn.Module], ckpt, parallel_state, *, strict: bool = True,
                        role: Optional[str] = None, world_group: Any = None, progress: bool = False) -> dict[str, int]:
    """`load_hf_weights` for a VLM: copy the HF checkpoint `ckpt` (an open HFCheckpoint) into this rank's chunks
    (`progress`: a small model's load shows none)."""
    role = role or model_role(model_chunks)
    spec, args, ordered = vlm_param_maps(ckpt.config, role)
    maps = {pm.mcore: pm for pm in ordered}
    read = _Reader(ckpt)
    n_tensors = n_bytes = 0
    for name, p, rank, size in vlm_local_params(model_chunks, spec, maps, parallel_state):
        if name == LM_PREFIX + VALUE_HEAD and role == "critic" and "score.weight" not in ckpt.files:
            continue  # a fresh value head keeps its initialisation
        shard = shard_for(maps[name], spec, args, read, rank, size, p.shape)
        p.data.copy_(shard)
        n_tensors += 1
        n_bytes += shard.numel() * shard.element_size()
    if strict:
        check_all_used(ckpt, read.used, role, world_group)
    return {"tensors": n_tensors, "bytes": n_bytes}


@torch.no_grad()
def iter_hf_vlm_weights(model_chunks: list[nn.Module], parallel_state, hf_config: Any, *,
                        bucket_bytes: int = 512 << 20, role: Optional[str] = None,
                        dtype: Optional[torch.dtype] = None, copy: bool = True, only_adapted: bool = False,
                        language_model_only: bool = False) -> Iterator[list]:
    """`iter_hf_weights` for a VLM: buckets of (HF name, full tensor), vision tower first. Collective.
    `language_model_only`: the language model's weights only (a frozen tower's never change: weight sync).
    `only_adapted`: LoRA adapters are not supported on these models."""
    if only_adapted:
        raise ValueError(NO_ADAPTERS)
    role = role or model_role(model_chunks)
    spec, args, ordered = vlm_param_maps(hf_config, role)
    maps = {pm.mcore: pm for pm in ordered}
    if language_model_only:
        ordered = [pm for pm in ordered if pm.mcore.startswith(LM_PREFIX)]
    ps = parallel_state
    mine = {n: p for n, p, _, _ in vlm_local_params(model_chunks, spec, maps, ps)}
    device = next(iter(mine.values())).device if mine else torch.device("cpu")
    owners = gather_owners({n: Meta(tuple(p.shape), p.dtype) for n, p in mine.items()}, ps.pp_group)

    def groups():
        for pm in ordered:
            if pm.mcore not in owners:
                raise RuntimeError(f"no pipeline stage holds {pm.mcore}; the chunks do not cover the model (role "
                                   f"{role})")
            src, meta = owners[pm.mcore]
            on_owner = ps.pp_rank == src if ps.pp_group is not None and ps.pp_size > 1 else True
            local = mine.get(pm.mcore)
            shard = broadcast_from(local.data if local is not None and on_owner else None, meta, src, ps.pp_group, device)
            shards = all_gather(shard, ps.tp_group) if pm.tp_dim is not None else [shard]
            yield hf_tensors(merge_for(pm, spec, args, shards), shards, dtype, copy)

    yield from bucketed(groups(), bucket_bytes)


def vlm_materialiser(model_chunks: list[nn.Module], ckpt, parallel_state, role: str, used: set[str]):
    """For the streaming `convert hf-to-mcore`: (materialise(meta parameter) -> its shard read from `ckpt`,
    {id(parameter): canonical name}); `used` collects the HF names read."""
    spec, args, ordered = vlm_param_maps(ckpt.config, role)
    maps = {pm.mcore: pm for pm in ordered}
    by_id = {id(p): (name, rank, size)
             for name, p, rank, size in vlm_local_params(model_chunks, spec, maps, parallel_state)}
    read = _Reader(ckpt)

    def materialise(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in by_id:
            raise not_a_parameter(tuple(t.shape), args.family)
        name, rank, size = by_id[id(t)]
        if name == LM_PREFIX + VALUE_HEAD and role == "critic" and "score.weight" not in ckpt.files:
            return t  # the fresh value head
        shard = shard_for(maps[name], spec, args, read, rank, size, t.shape)
        used.update(read.used)
        return shard

    return materialise, by_id


def iter_hf_vlm_weights_from_checkpoint(mcore_dir: str, hf_config: Any, role: str, *,
                                        dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) straight out of a megatron dist_checkpoint, one parameter at a time (no model built):
    `dist_reader`'s global tensors are the TP-1 parameters (vision blocks are saved unstacked, one per block)."""
    from megappo.convert.dist_reader import DistCheckpointReader

    reader = DistCheckpointReader(mcore_dir)
    spec, args, ordered = vlm_param_maps(hf_config, role)
    for pm in ordered:
        t = reader.read(pm.mcore, LM_PREFIX) if pm.mcore.startswith(LM_PREFIX) else reader.read(pm.mcore)
        for name, full in merge_for(pm, spec, args, [t]):
            yield name, (full.to(dtype) if dtype is not None else full)


def hf_vlm_state_dict(model_chunks, parallel_state, hf_config, **kw) -> dict[str, torch.Tensor]:
    """All of `iter_hf_vlm_weights` in one dict (tests and small models)."""
    return {n: t for b in iter_hf_vlm_weights(model_chunks, parallel_state, hf_config, **kw) for n, t in b}


