"""This rank's parameters under their canonical (layout-independent) names, and the checks a Hugging Face load
ends with: what every model kind's conversion shares."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megappo.convert.hf_io import HFCheckpoint
from megappo.convert.mapping import ConversionError, ModelSpec, ParamMap, canonical_name
from megappo.models.builder import unwrap
from megappo.parallel import ParallelState

# HF tensors that are not weights of the model (older checkpoints store rotary tables).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class LocalParam:
    """A parameter of this rank under its canonical name, with the TP coordinates its shard is cut at."""

    canonical: str
    param: torch.Tensor  # this rank's shard
    tp_rank: int
    tp_size: int


def model_role(model_chunks: list[nn.Module]) -> str:
    """The role recorded by `megappo.models.builder.build_model` (actor when built elsewhere)."""
    return getattr(unwrap(model_chunks[0]), "megappo_role", "actor")


def local_params(model_chunks: list[nn.Module], spec: ModelSpec, parallel_state: ParallelState,
                 maps: dict[str, ParamMap], merge_lora: bool = False) -> list[LocalParam]:
    """Every parameter of this rank's chunks, canonically named and checked against the mapping `maps`.

    LoRA adapter factors (`megappo.models.lora`) are not HF parameters and are left out; with `merge_lora` an
    adapted layer's weight is given as its merged shard (a new tensor) instead of the parameter.
    Raises ConversionError for a megatron parameter the mapping does not know (a spec/config mismatch).
    """
    from megappo.models.lora import base_parameters

    ep_size = parallel_state.ep_size
    num_local = spec.num_experts // ep_size if spec.num_experts else 0
    out = []
    for chunk in model_chunks:
        m = unwrap(chunk)
        layer_numbers = [layer.layer_number for layer in m.decoder.layers] if hasattr(m, "decoder") else []
        for local, p in base_parameters(m, merged=merge_lora):
            name = canonical_name(local, layer_numbers, parallel_state.ep_rank * num_local)
            if name == "output_layer.weight" and spec.tied_embeddings and name not in maps:
                name = "embedding.word_embeddings.weight"  # last stage's copy of the tied embedding (PP > 1)
            pm = maps.get(name)
            if pm is None:
                raise ConversionError(
                    f"megatron parameter {local!r} (canonical {name!r}, shape {tuple(p.shape)}) has no Hugging Face "
                    f"counterpart for family {spec.family}; the model was built from a different config"
                )
            if pm.tp_dim is None:
                rank, size = 0, 1
            elif pm.expert:
                rank, size = parallel_state.etp_rank, parallel_state.etp_size
            else:
                rank, size = parallel_state.tp_rank, parallel_state.tp_size
            out.append(LocalParam(name, p, rank, size))
    return out


def not_a_parameter(shape: tuple, family: str) -> ConversionError:
    """The refusal of a checkpoint tensor no parameter of the model owns (streaming conversion)."""
    return ConversionError(f"a checkpoint tensor of shape {shape} is no parameter of the {family} model; this model "
                           "part cannot be converted by streaming")


def check_all_used(ckpt: HFCheckpoint, used: set[str], role: str, group: Any) -> None:
    from megappo.parallel import union_over_ranks

    """ConversionError naming the tensors of `ckpt` no rank used (`used`: this rank's HF names); collective over
    `group`, default the whole world."""
    used = union_over_ranks(used, group)
    ignored = {"lm_head.weight"} if role in ("critic", "reward") else set()
    unused = sorted(n for n in ckpt.files if n not in used and n not in ignored and not n.endswith(_IGNORED_SUFFIXES))
    if unused:
        raise ConversionError(
            f"{ckpt.path}: {len(unused)} tensors have no place in the megatron model (e.g. {unused[:3]}); the "
            f"weights do not match config.json (pass strict=False to ignore)"
        )
