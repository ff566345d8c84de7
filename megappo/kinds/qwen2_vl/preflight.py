"""Preflight rules of a vision-language run (a Qwen2.5-VL / Qwen2-VL actor): what the trainer does not support with
one yet is refused before any rank starts, each message naming the key and the fix. This kind's `preflight`
(`megappo.kinds`), which `megappo.trainer.preflight` asks of the run's model kind. The config tree stands above the
model kinds (`megappo.testing.structure.PACKAGE_ORDER`), so `cfg` is typed Any here."""
from __future__ import annotations

from typing import Any

from megappo.models.lora.checks import refuse_lora


def preflight(cfg: Any, engine_takes_images: bool = True) -> list[str]:
    """An error for each setting a vision-language run does not support yet. engine_takes_images: whether the
    run's rollout engine feeds the prompts' images (the trainer asks the engines' registry)."""
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
    errors += refuse_lora(cfg, what)
    if arr.rollout.multi_turn.enable:
        errors.append(f"actor_rollout_ref.rollout.multi_turn.enable: multi-turn rollouts {what}; set it to false")
    if not engine_takes_images:
        errors.append(f"actor_rollout_ref.rollout: {arr.rollout.name} does not take images yet; use rollout.name=hf "
                      "with actor_rollout_ref.hybrid_engine=true (the in-process engine; async_training.mode=sync)")
    if cfg.reward_model.enable:
        errors.append(f"reward_model.enable: a reward model {what} (it would not see the images); use a rule "
                      "reward (reward_model.enable=false)")
    return errors
