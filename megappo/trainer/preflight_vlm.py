"""Preflight rules of vision-language runs (Qwen2.5-VL / Qwen2-VL actors): what the trainer does not
support with them yet is refused before any rank starts, each message naming the key and the fix.

Light to import (no torch): the model type comes from `<model.path>/config.json` when it is there; a synthetic task
is a vision-language one when it defines the vision tower of its model (`megappo.tasks.colour_square`).
"""
from __future__ import annotations

from typing import Optional

from megappo.config import MegappoConfig
from megappo.kinds import kind_of
from megappo.models.lora.checks import refuse_lora


def _synthetic_is_vlm(name: Optional[str]) -> bool:
    if not name:
        return False
    from megappo.tasks import TASKS

    task = TASKS.get(name)  # an unknown task is preflight's own error (`_check_synthetic_task`)
    return getattr(task, "vision", None) is not None  # an image task's tiny model has a vision tower


def is_vlm_run(cfg: MegappoConfig) -> bool:
    """Whether the run's actor is a vision-language model."""
    return kind_of(cfg.actor_rollout_ref.model.path).multi_modal or _synthetic_is_vlm(cfg.data.synthetic.name)


def _engine_without_images(cfg: MegappoConfig) -> Optional[str]:
    """The engine this run deploys when its registry entry does not say `multi_modal` (None: it does, or the engine
    is unknown: preflight's own error)."""
    from megappo.rollout.registry import multi_modal, unknown_engine

    name = cfg.actor_rollout_ref.rollout.name
    return None if unknown_engine(name) or multi_modal(name) else name


def check_vision_language(cfg: MegappoConfig, errors: list[str]) -> None:
    """Append an error for each setting a vision-language run does not support yet."""
    if not is_vlm_run(cfg):
        return
    arr = cfg.actor_rollout_ref
    what = "is not supported with a vision-language model (Qwen2.5-VL / Qwen2-VL) yet"
    roles = [("actor_rollout_ref.actor", arr.actor.megatron)]
    if cfg.critic.enable:
        roles.append(("critic", cfg.critic.megatron))
    for role, meg in roles:
        if meg.sequence_parallel:
            errors.append(f"{role}.megatron.sequence_parallel: {what}; set it to false")
        if meg.context_parallel_size > 1:
            errors.append(f"{role}.megatron.context_parallel_size={meg.context_parallel_size}: {what}; set it to 1")
        if meg.virtual_pipeline_model_parallel_size:
            errors.append(f"{role}.megatron.virtual_pipeline_model_parallel_size: {what}; set it to null")
    errors += refuse_lora(cfg, what)
    if arr.rollout.multi_turn.enable:
        errors.append(f"actor_rollout_ref.rollout.multi_turn.enable: multi-turn rollouts {what}; set it to false")
    engine = _engine_without_images(cfg)
    if engine:
        errors.append(f"actor_rollout_ref.rollout: {engine} does not take images yet; use rollout.name=hf with "
                      "actor_rollout_ref.hybrid_engine=true (the in-process engine; async_training.mode=sync)")
    if cfg.reward_model.enable:
        errors.append(f"reward_model.enable: a reward model {what} (it would not see the images); use a rule "
                      "reward (reward_model.enable=false)")
