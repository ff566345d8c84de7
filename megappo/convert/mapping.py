"""Name and tensor mapping between Hugging Face checkpoints and megatron-core GPTModel parameters.

Pure data and tensor arithmetic, no process groups: `hf_to_mcore` and `export` add the I/O and communication.

Every megatron parameter is described by a `ParamMap` under its *canonical* name: the local-spec name with the
global layer index and the global expert index (`decoder.layers.7.mlp.experts.local_experts.5.linear_fc1.weight`).
`canonical_name` turns a rank's local name (local layer index within its pipeline chunk, local expert index,
transformer-engine spellings) into that form, so one table serves every layout and both layer specs.

Megatron's fused tensors, and how each tensor-parallel rank's shard is laid out:
- `linear_qkv` ([groups * (q_per_group + 2) * head_dim, hidden]): per query group g, the rows of its query heads,
  then its key head, then its value head. TP splits whole groups, so rank r's shard is groups
  [r*G/tp, (r+1)*G/tp), again interleaved.
- `linear_fc1` of a gated MLP ([2 * ffn, hidden]): gate rows then up rows. TP splits gate and up separately, so rank
  r's shard is [gate[r-th chunk]; up[r-th chunk]] (not a contiguous slice of the full tensor).
- vocab-parallel embedding / output layer ([padded_vocab, hidden]): megatron pads the vocabulary (to a multiple of
  its divisor times tp); the padded rows are zero on import and dropped on export.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional

import torch

from megappo.models.families import FAMILIES
from megappo.models.hf_config import HFArchitecture, UnsupportedModelError, read_hf_architecture
from megappo.models.naming import canonical_name  # noqa: F401 - the conversion's name for it

Kind = Literal["copy", "qkv", "glu", "vocab"]
Role = Literal["actor", "ref", "critic", "reward"]

# megatron name of the critic / reward model's scalar head (see megappo.models.builder): an output layer with one row.
VALUE_HEAD = "output_layer.weight"

# The shape facts of a HF decoder that decide its tensor names and shapes: read by the one HF config reader.
ModelSpec = HFArchitecture


class ConversionError(ValueError):
    """A checkpoint that cannot be converted; the message names the file/tensor and the fix."""


def model_spec_from_hf_config(cfg: Any, source: str = "config.json") -> ModelSpec:
    """Read a HF config (dict of config.json or a transformers config object) into a ModelSpec.

    Raises ConversionError naming `source` for an unsupported architecture.
    """
    try:
        return read_hf_architecture(cfg, source)
    except UnsupportedModelError as e:
        raise ConversionError(str(e)) from e


@dataclass(frozen=True)
class ParamMap:
    """One megatron parameter (canonical name) and the HF tensors it is made of."""

    mcore: str  # canonical megatron name: global layer and expert indices, local-spec spelling
    hf: tuple[str, ...]  # HF tensors: (q, k, v) for "qkv", (gate, up) for "glu", one otherwise
    kind: Kind
    tp_dim: Optional[int]  # dim split across tensor-parallel ranks; None: replicated
    expert: bool = False  # an expert weight: split over the expert-parallel and expert-TP groups
    layer: Optional[int] = None  # global layer index; None for embedding, final norm and head


def _hf_moe_names(spec: ModelSpec, i: int, e: int) -> tuple[str, str, str]:
    """(gate, up, down) HF names of expert e in layer i (families share HF names except in their MoE blocks)."""
    names = FAMILIES[spec.family].moe
    p = f"model.layers.{i}.{names.block}.experts.{e}"
    return f"{p}.{names.gate}.weight", f"{p}.{names.up}.weight", f"{p}.{names.down}.weight"


def layer_param_maps(spec: ModelSpec, i: int) -> list[ParamMap]:
    """The ParamMaps of decoder layer i (global index), in a fixed order."""
    hf, mc = f"model.layers.{i}", f"decoder.layers.{i}"
    attn = f"{hf}.self_attn"
    maps = [
        ParamMap(f"{mc}.input_layernorm.weight", (f"{hf}.input_layernorm.weight",), "copy", None, layer=i),
        ParamMap(f"{mc}.self_attention.linear_qkv.weight",
                 (f"{attn}.q_proj.weight", f"{attn}.k_proj.weight", f"{attn}.v_proj.weight"), "qkv", 0, layer=i),
    ]
    if spec.qkv_bias:
        maps.append(ParamMap(f"{mc}.self_attention.linear_qkv.bias",
                             (f"{attn}.q_proj.bias", f"{attn}.k_proj.bias", f"{attn}.v_proj.bias"), "qkv", 0, layer=i))
    if spec.qk_norm:
        maps += [
            ParamMap(f"{mc}.self_attention.q_layernorm.weight", (f"{attn}.q_norm.weight",), "copy", None, layer=i),
            ParamMap(f"{mc}.self_attention.k_layernorm.weight", (f"{attn}.k_norm.weight",), "copy", None, layer=i),
        ]
    maps += [
        ParamMap(f"{mc}.self_attention.linear_proj.weight", (f"{attn}.o_proj.weight",), "copy", 1, layer=i),
        ParamMap(f"{mc}.pre_mlp_layernorm.weight", (f"{hf}.post_attention_layernorm.weight",), "copy", None, layer=i),
    ]
    if not spec.moe_layers[i]:
        m = f"{hf}.mlp"
        return maps + [
            ParamMap(f"{mc}.mlp.linear_fc1.weight", (f"{m}.gate_proj.weight", f"{m}.up_proj.weight"), "glu", 0, layer=i),
            ParamMap(f"{mc}.mlp.linear_fc2.weight", (f"{m}.down_proj.weight",), "copy", 1, layer=i),
        ]
    router = f"{hf}.{FAMILIES[spec.family].moe.block}.gate.weight"
    maps.append(ParamMap(f"{mc}.mlp.router.weight", (router,), "copy", None, layer=i))
    for e in range(spec.num_experts):
        gate, up, down = _hf_moe_names(spec, i, e)
        x = f"{mc}.mlp.experts.local_experts.{e}"
        maps += [
            ParamMap(f"{x}.linear_fc1.weight", (gate, up), "glu", 0, expert=True, layer=i),
            ParamMap(f"{x}.linear_fc2.weight", (down,), "copy", 1, expert=True, layer=i),
        ]
    if spec.shared_expert_size:
        s = f"{hf}.mlp.shared_expert"
        maps += [
            ParamMap(f"{mc}.mlp.shared_experts.linear_fc1.weight", (f"{s}.gate_proj.weight", f"{s}.up_proj.weight"),
                     "glu", 0, layer=i),
            ParamMap(f"{mc}.mlp.shared_experts.linear_fc2.weight", (f"{s}.down_proj.weight",), "copy", 1, layer=i),
        ]
        if spec.shared_expert_gate:
            maps.append(ParamMap(f"{mc}.mlp.shared_experts.gate_weight", (f"{hf}.mlp.shared_expert_gate.weight",),
                                 "copy", None, layer=i))
    return maps


def param_maps(spec: ModelSpec, role: Role = "actor") -> list[ParamMap]:
    """Every megatron parameter of a model of `role`, in the global order export walks them.

    actor/ref: the causal LM (`output_layer` absent when embeddings are tied). critic/reward: the value head
    `VALUE_HEAD` ([1, hidden], replicated) maps to a sequence-classification `score.weight`.
    """
    maps = [ParamMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", 0)]
    for i in range(spec.num_layers):
        maps += layer_param_maps(spec, i)
    maps.append(ParamMap("decoder.final_layernorm.weight", ("model.norm.weight",), "copy", None))
    if role in ("critic", "reward"):
        maps.append(ParamMap(VALUE_HEAD, ("score.weight",), "copy", None))
    elif not spec.tied_embeddings:
        maps.append(ParamMap("output_layer.weight", ("lm_head.weight",), "vocab", 0))
    return maps


# -- tensor arithmetic of one tensor-parallel shard ------------------------------------------------------------
# read(hf_name, dim, start, stop) -> the rows (dim 0) or columns (dim 1) [start, stop) of that HF tensor;
# dim None reads the whole tensor.
Reader = Callable[[str, Optional[int], int, int], torch.Tensor]


def _qkv_geometry(spec: ModelSpec) -> tuple[int, int]:
    """(query heads per group, head_dim)."""
    return spec.num_heads // spec.num_kv_heads, spec.head_dim


def shard_from_hf(pm: ParamMap, spec: ModelSpec, read: Reader, rank: int, size: int,
                  local_shape: tuple[int, ...]) -> torch.Tensor:
    """Build the shard that TP rank `rank` of `size` holds of parameter `pm`, reading only the HF rows it needs.

    local_shape: the shape of that rank's megatron parameter (checked; its dim 0 also gives the padded vocab rows).
    """
    if pm.kind == "copy":
        if pm.tp_dim is None or size == 1:
            out = read(pm.hf[0], None, 0, 0)
        else:
            n = local_shape[pm.tp_dim]
            out = read(pm.hf[0], pm.tp_dim, rank * n, (rank + 1) * n)
    elif pm.kind == "qkv":
        qpg, hd = _qkv_geometry(spec)
        groups = spec.num_kv_heads // size
        g0 = rank * groups
        q = read(pm.hf[0], 0, g0 * qpg * hd, (g0 + groups) * qpg * hd)
        k = read(pm.hf[1], 0, g0 * hd, (g0 + groups) * hd)
        v = read(pm.hf[2], 0, g0 * hd, (g0 + groups) * hd)
        rest = q.shape[1:]
        out = torch.cat([q.reshape(groups, qpg * hd, *rest), k.reshape(groups, hd, *rest),
                         v.reshape(groups, hd, *rest)], dim=1).reshape(-1, *rest)
    elif pm.kind == "glu":
        n = local_shape[0] // 2
        out = torch.cat([read(pm.hf[0], 0, rank * n, (rank + 1) * n), read(pm.hf[1], 0, rank * n, (rank + 1) * n)])
    elif pm.kind == "vocab":
        rows = local_shape[0]
        start, stop = rank * rows, min((rank + 1) * rows, spec.vocab_size)
        part = read(pm.hf[0], 0, start, stop) if stop > start else None
        # megatron's padded rows: zero so that they never win an argmax before training touches them
        out = torch.zeros(local_shape, dtype=part.dtype if part is not None else torch.float32)
        if part is not None:
            out[: stop - start] = part
    else:  # pragma: no cover - Kind is closed
        raise AssertionError(pm.kind)
    if tuple(out.shape) != tuple(local_shape):
        raise ConversionError(
            f"{pm.mcore}: HF tensor(s) {', '.join(pm.hf)} give a shard of shape {tuple(out.shape)} at tensor-parallel "
            f"rank {rank}/{size}, but the megatron parameter is {tuple(local_shape)}; the checkpoint does not match "
            f"its config.json"
        )
    return out


def expected_hf_shapes(pm: ParamMap, spec: ModelSpec, local_shape: tuple[int, ...], size: int) -> dict[str, tuple]:
    """The full HF shapes the megatron shard `local_shape` (of `size` TP ranks) implies, per HF tensor name."""
    rest = tuple(local_shape[1:])
    if pm.kind == "qkv":
        return {pm.hf[0]: (spec.num_heads * spec.head_dim, *rest), pm.hf[1]: (spec.num_kv_heads * spec.head_dim, *rest),
                pm.hf[2]: (spec.num_kv_heads * spec.head_dim, *rest)}
    if pm.kind == "glu":
        return {n: (local_shape[0] // 2 * size, *rest) for n in pm.hf}
    if pm.kind == "vocab":
        return {pm.hf[0]: (spec.vocab_size, *rest)}
    shape = list(local_shape)
    if pm.tp_dim is not None:
        shape[pm.tp_dim] *= size
    return {pm.hf[0]: tuple(shape)}


def merge_to_hf(pm: ParamMap, spec: ModelSpec, shards: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Inverse of shard_from_hf: the TP shards of `pm` in rank order -> [(hf_name, full tensor)]."""
    size = len(shards)
    if pm.kind == "copy":
        full = shards[0] if pm.tp_dim is None or size == 1 else torch.cat(shards, dim=pm.tp_dim)
        return [(pm.hf[0], full)]
    if pm.kind == "vocab":
        return [(pm.hf[0], torch.cat(shards, dim=0)[: spec.vocab_size] if size > 1 else shards[0][: spec.vocab_size])]
    if pm.kind == "glu":
        halves = [s.chunk(2, dim=0) for s in shards]
        if size == 1:  # contiguous views: a caller that keeps them copies them (export's copy=True does)
            return [(pm.hf[0], halves[0][0]), (pm.hf[1], halves[0][1])]
        return [(pm.hf[0], torch.cat([h[0] for h in halves]).contiguous()),
                (pm.hf[1], torch.cat([h[1] for h in halves]).contiguous())]
    qpg, hd = _qkv_geometry(spec)
    full = torch.cat(shards, dim=0) if size > 1 else shards[0]
    rest = full.shape[1:]
    grouped = full.reshape(spec.num_kv_heads, (qpg + 2) * hd, *rest)
    q, k, v = grouped.split([qpg * hd, hd, hd], dim=1)
    return [(name, t.reshape(-1, *rest).contiguous()) for name, t in zip(pm.hf, (q, k, v))]
