"""The config's LoRA rules (`model.lora`, `critic.model.lora.share_actor_base`, `rollout.lora_sync`), collected
into the messages `megappo.checks` reports; reads the tree alone (no torch)."""
from __future__ import annotations

import os
from typing import Optional


def lora_errors(cfg, check_files: bool, adapter_refusal: Optional[str] = None) -> list[str]:
    """Every LoRA rule of `cfg`. adapter_refusal: why the rollout engine cannot serve adapters on this device
    (`megappo.rollout.registry.lora_adapter_refusal`, asked by `megappo.checks`: the engines stand above models)."""
    errors: list[str] = []
    for prefix, model in (("actor_rollout_ref.model.lora", cfg.actor_rollout_ref.model),
                          ("critic.model.lora", cfg.critic.model)):
        _check_lora(prefix, model.lora, errors, check_files)
    _check_shared_critic_base(cfg, errors)
    _check_lora_sync(cfg, errors, adapter_refusal)
    return errors


TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # megatron's linear layers an adapter fits


def refuse_lora(cfg, what: str) -> list[str]:
    """The message refusing LoRA on either model for a feature it does not combine with (`what`); none without."""
    if cfg.actor_rollout_ref.model.lora.rank > 0 or (cfg.critic.enable and cfg.critic.model.lora.rank > 0):
        return [f"actor_rollout_ref.model.lora.rank: LoRA {what}; set lora.rank=0 (full fine-tuning)"]
    return []


def _check_lora_sync(cfg, errors: list[str], adapter_refusal: Optional[str]) -> None:
    """rollout.lora_sync=adapter: a LoRA actor served by an engine that serves adapters on this device."""
    arr = cfg.actor_rollout_ref
    if arr.rollout.lora_sync != "adapter":
        return
    key = "actor_rollout_ref.rollout.lora_sync=adapter"
    if arr.model.lora.rank <= 0:
        errors.append(f"{key} sends a LoRA actor's adapters: set actor_rollout_ref.model.lora.rank > 0 or "
                      "lora_sync=merged")
    if adapter_refusal:
        errors.append(f"{key} {adapter_refusal}")


def _check_shared_critic_base(cfg, errors: list[str]) -> None:
    """critic.model.lora.share_actor_base: the critic's base must be the actor's model, loaded the same way."""
    actor, critic = cfg.actor_rollout_ref.model, cfg.critic.model
    if actor.lora.share_actor_base:
        errors.append("actor_rollout_ref.model.lora.share_actor_base: only critic.model.lora takes it (the critic "
                      "shares the actor's base)")
    if not critic.lora.share_actor_base or not cfg.critic.enable:
        return
    key = "critic.model.lora.share_actor_base=true"
    if actor.lora.rank <= 0 or critic.lora.rank <= 0:
        errors.append(f"{key} needs LoRA on both models (actor_rollout_ref.model.lora.rank={actor.lora.rank}, "
                      f"critic.model.lora.rank={critic.lora.rank}): a full-parameter model trains its base; set "
                      "both ranks > 0 or share_actor_base=false")
    a_path, c_path = (os.path.abspath(os.path.expanduser(p)) if p else p for p in (actor.path, critic.path))
    if c_path != a_path:
        errors.append(f"{key}: critic.model.path={critic.path} is not the actor's model ({actor.path}); drop "
                      "critic.model.path or set share_actor_base=false")
    for name in ("override_config", "dtype"):
        if getattr(critic, name) != getattr(actor, name) and getattr(critic, name) is not None:
            errors.append(f"{key}: critic.model.{name}={getattr(critic, name)!r} differs from the actor's "
                          f"({getattr(actor, name)!r}): the shared base is built once, as the actor's; make them "
                          "equal or set share_actor_base=false")


def _check_lora(prefix: str, lora, errors: list[str], check_files: bool) -> None:
    """model.lora: the adapter shape (`layers.py` here)."""
    if lora.rank < 0:
        errors.append(f"{prefix}.rank={lora.rank}: use 0 (no LoRA) or a positive rank such as 8, 16, 64")
    if lora.rank == 0:
        return
    if lora.alpha <= 0:
        errors.append(f"{prefix}.alpha={lora.alpha}: must be > 0 (adapters are scaled by alpha / rank)")
    if not 0.0 <= lora.dropout < 1.0:
        errors.append(f"{prefix}.dropout={lora.dropout}: must be in [0, 1)")
    bad = [t for t in lora.target_modules if t not in TARGETS]
    if bad or not lora.target_modules:
        errors.append(f"{prefix}.target_modules={list(lora.target_modules)}: choose among {list(TARGETS)} "
                      "(megatron's layer names)")
    if check_files and lora.adapter_path and not os.path.isfile(
            os.path.join(os.path.expanduser(lora.adapter_path), "adapter_model.safetensors")):
        errors.append(f"{prefix}.adapter_path={lora.adapter_path}: no adapter_model.safetensors there; point it at "
                      "a PEFT adapter directory (megappo convert mcore-to-hf --lora-only writes one)")
