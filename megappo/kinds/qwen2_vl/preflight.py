"""Preflight rules of a vision-language run (a Qwen2.5-VL / Qwen2-VL actor): what the trainer does not support with
one yet is refused before any rank starts, each message naming the key and the fix. This kind's `preflight`
(`megappo.kinds`), which `megappo.trainer.preflight` asks of the run's model kind."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from megappo.config import MegappoConfig


def _engine_without_images(cfg: MegappoConfig) -> Optional[str]:
    """The engine class this run deploys when its `generate` has no `multi_modal` keyword (None: it has one, or the
    engine is unknown: preflight's own error)."""
    import importlib
    import inspect

    ro, arr = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref
    classes = {"hf": ("megappo.rollout.hf.engine", "HFEngine") if arr.hybrid_engine else
               ("megappo.rollout.hf.process", "HFProcessEngine"),
               "sglang": ("megappo.rollout.sglang.engine", "SGLangEngine")}
    if ro.name not in classes:
        return None
    module, name = classes[ro.name]
    cls = getattr(importlib.import_module(module), name)
    return None if "multi_modal" in inspect.signature(cls.generate).parameters else name


def preflight(cfg: MegappoConfig) -> list[str]:
    """An error for each setting a vision-language run does not support yet."""
    errors: list[str] = []
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
    if arr.model.lora.rank > 0 or (cfg.critic.enable and cfg.critic.model.lora.rank > 0):
        errors.append(f"actor_rollout_ref.model.lora.rank: LoRA {what}; set lora.rank=0 (full fine-tuning)")
    if arr.rollout.multi_turn.enable:
        errors.append(f"actor_rollout_ref.rollout.multi_turn.enable: multi-turn rollouts {what}; set it to false")
    engine = _engine_without_images(cfg)
    if engine:
        errors.append(f"actor_rollout_ref.rollout: {engine} does not take images yet; use rollout.name=hf with "
                      "actor_rollout_ref.hybrid_engine=true (the in-process engine; async_training.mode=sync)")
    if cfg.reward_model.enable:
        errors.append(f"reward_model.enable: a reward model {what} (it would not see the images); use a rule "
                      "reward (reward_model.enable=false)")
    return errors
