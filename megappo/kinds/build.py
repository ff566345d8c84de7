"""Build a model as its kind builds it: `build_model`, the trainer's and the conversion's one way to a role's chunks
(`megappo.models.builder` holds the text families' builder and the helpers every kind shares)."""
from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Union

from torch import nn

from megappo.kinds import kind_of
from megappo.models.builder import ROLES, unwrap
from megappo.parallel import ParallelState
from megappo.platform.device import Platform
from megappo.platform.layout import ParallelLayout


def build_model(
    hf_dir_or_config: Union[str, os.PathLike, Mapping[str, Any], Any],
    role: str,
    parallel_state: ParallelState,
    platform: Platform,
    *,
    layout: Optional[ParallelLayout] = None,
    seed: int = 0,
    config_overrides: Optional[Mapping[str, Any]] = None,
    make_vocab_size_divisible_by: int = 128,
    freeze_vision_tower: bool = True,
) -> list[nn.Module]:
    """Build this rank's model chunks for `role` ("actor", "ref", "critic", "reward"), as the model's kind builds
    them (`megappo.kinds.kind_of`): GPTModels for the text families (`megappo.models.builder.build_gpt_model`),
    `VLMModel`s for Qwen2.5-VL / Qwen2-VL (`megappo.kinds.qwen2_vl.model`; vision tower frozen when
    `freeze_vision_tower`, which a text model has no use for).

    Weights are randomly initialised by megatron from `seed` (this re-seeds torch's and megatron's model-parallel
    RNGs; same seed and layout give the same weights); load real ones with `megappo.kinds.weights.load_hf_weights`
    or `checkpoint.load_model_checkpoint`. `layout` defaults to `parallel_state.layout`. Each chunk gets
    `.megappo_config` (TransformerConfig), `.megappo_spec` (ModelSpecArgs) and `.megappo_role` attributes.
    """
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; choose one of {ROLES}")
    layout = layout or parallel_state.layout
    if layout != parallel_state.layout:
        raise ValueError(f"layout {layout} differs from the initialised parallel layout {parallel_state.layout}")
    return kind_of(hf_dir_or_config).build(
        hf_dir_or_config, role, parallel_state, platform, seed=seed, config_overrides=config_overrides,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by, freeze_vision_tower=freeze_vision_tower)


# Conversion never trains: build the frozen twin of a role (same parameters and names), which also keeps megatron's
# training-only checks (MoE with TP > 1 needs sequence parallel) out of the way.
_FROZEN_TWIN = {"actor": "ref", "critic": "reward"}


def build_for_conversion(hf_dir_or_config: Any, role: str, parallel_state: ParallelState,
                         platform: Any) -> list[nn.Module]:
    """This rank's model chunks of `role` with uninitialised weights (every one is loaded next), in eval mode."""
    chunks = build_model(hf_dir_or_config, _FROZEN_TWIN.get(role, role), parallel_state, platform,
                         config_overrides={"perform_initialization": False})
    for chunk in chunks:
        unwrap(chunk).megappo_role = role  # what the saved checkpoint records
    return chunks
