"""The model's weights as its kind reads and writes them: `load_hf_weights` (HF checkpoint -> model chunks) and
`iter_hf_weights` (model chunks -> HF tensors), the trainer's and the conversion commands' one way in and out. The
text families' implementations and the pieces every kind shares are `megappo.convert`'s."""
from __future__ import annotations

from typing import Any, Iterator, Optional, Union

import torch
from torch import nn

from megappo.convert.collectives import Bucket
from megappo.convert.hf_io import HFCheckpoint
from megappo.kinds import kind_of
from megappo.parallel import ParallelState


@torch.no_grad()
def load_hf_weights(model_chunks: list[nn.Module], hf_dir: Union[str, HFCheckpoint], parallel_state: ParallelState, *,
                    strict: bool = True, role: Optional[str] = None, world_group: Any = None,
                    progress: bool = False) -> dict[str, int]:
    """Copy a HF checkpoint into this rank's `model_chunks` (any TP/PP/VPP/EP layout); return {tensors, bytes}.

    role: None reads the chunks' `megappo_role`. critic: from a causal LM the value head keeps its fresh
    initialisation and the LM head is ignored (from a sequence-classification checkpoint it takes `score.weight`);
    reward: `score.weight` -> the value head. strict: every megatron parameter on every rank was
    loaded and every HF tensor was used by some rank (checked with one all_gather_object over `world_group`,
    default the whole world); an unused tensor means the config and the weights disagree.
    """
    ckpt = hf_dir if isinstance(hf_dir, HFCheckpoint) else HFCheckpoint.open(hf_dir)
    return kind_of(ckpt.config).load_hf_weights(model_chunks, ckpt, parallel_state, strict=strict, role=role,
                                                world_group=world_group, progress=progress)


def iter_hf_weights(model_chunks: list[nn.Module], parallel_state: ParallelState, hf_config: Any, *,
                    bucket_bytes: int = 512 << 20, role: Optional[str] = None,
                    dtype: Optional[torch.dtype] = None, copy: bool = True, only_adapted: bool = False,
                    language_model_only: bool = False) -> Iterator[Bucket]:
    """Yield buckets (lists of (hf_name, full tensor)) of about `bucket_bytes` covering the whole model, as the
    model's kind (`megappo.kinds.kind_of(hf_config)`) exports it.

    hf_config: the HF config (dict or transformers config) the model was built from. role: None reads the chunks'
    `megappo_role`; critic/reward yield the value head as `score.weight` and no `lm_head`. dtype: cast each tensor.
    Collective: every rank of the world calls it with the same arguments; see `megappo.convert.export` for which
    groups are used. Tensors are on the parameters' device; fresh copies (safe to keep) unless `copy=False`, which
    may yield views of the parameters, valid until they next change (`megappo.convert.export`).

    A LoRA model (`megappo.models.lora`) yields its merged weights (W + scaling * B A; adapters that are off
    leave W); `only_adapted` yields only the adapted layers' weights, the ones a LoRA step changes (every rank
    must pass the same value). `language_model_only`: a multi-modal model's language model alone (a frozen vision
    tower never changes); the whole of a text model.
    """
    yield from kind_of(hf_config).iter_hf_weights(
        model_chunks, parallel_state, hf_config, bucket_bytes=bucket_bytes, role=role, dtype=dtype, copy=copy,
        only_adapted=only_adapted, language_model_only=language_model_only)


def hf_state_dict(model_chunks: list[nn.Module], parallel_state: ParallelState, hf_config: Any, **kw: Any) -> dict:
    """All of `iter_hf_weights` in one dict (small models and tests only: it holds the whole model)."""
    return {name: t for bucket in iter_hf_weights(model_chunks, parallel_state, hf_config, **kw) for name, t in bucket}
