"""The rollout engines by `actor_rollout_ref.rollout.name`: for each, `deploy(settings, ps, platform)` (a
`RolloutDeployment`, collective, from the plain `RolloutSettings`) and, optionally, `preflight(cfg) -> list[str]`,
its reasons to refuse the run before anything starts (a missing package). "module:function" strings, imported when used: naming an engine does not
import the others, and the config's checks import no torch."""
from __future__ import annotations

import difflib
import importlib
from typing import Any, Optional

ENGINES: dict[str, dict[str, Any]] = {
    # in-process transformers model, one per data-parallel replica (the CPU default)
    "hf": {"deploy": "megappo.rollout.hf.deploy:deploy", "modes": ("sync",), "sync_modes": ("tensor",),
           "partial_rollout": True, "multi_modal": True, "routed_experts": True},
    # SGLang servers the trainer starts per node (or rollout.server_urls), shared by every replica
    "sglang": {"deploy": "megappo.rollout.sglang.deploy:deploy", "preflight": "megappo.rollout.sglang.deploy:preflight",
               "modes": ("async",), "sync_modes": ("distributed", "tensor", "disk"), "partial_rollout": True,
               "multi_modal": True, "routed_experts": True, "lora_adapters": ("cuda",)},
    # vLLM servers the trainer starts (or server_urls), or vLLM's engine in the trainer's ranks (mode=sync)
    "vllm": {"deploy": "megappo.rollout.vllm.deploy:deploy", "preflight": "megappo.rollout.vllm.deploy:preflight",
             "modes": ("async", "sync"), "sync_modes": {"async": ("distributed", "disk"), "sync": ("tensor",)},
             "partial_rollout": True, "multi_modal": True, "routed_experts": True, "lora_adapters": ("cuda", "cpu")},
}
# modes: the deployments (rollout.mode) it has, the first its default (absent: sync, the engine in the ranks).
# sync_modes: the values of rollout.weight_sync the engine's `load_weights` takes ("disk": a Hugging Face directory it
# reloads), per mode where they differ; "auto" is the first. partial_rollout: its `abort` makes `generate` answer with the tokens it has
# (async_training.partial_rollout continues them); False when absent. multi_modal: its `generate` takes the prompts'
# images (`multi_modal=`, vision-language models); routed_experts: its completions carry each token's MoE routes
# when SamplingParams.return_routed_experts (router replay R3); lora_adapters: the devices (trainer.device) on which
# its `load_lora_adapter` serves a LoRA actor's adapters (rollout.lora_sync=adapter). A deployment may refuse what
# its mode lacks (its preflight says why).


def engine_names() -> list[str]:
    return sorted(ENGINES)


def unknown_engine(name: str) -> Optional[str]:
    """Why `name` is no engine (None: it is one), naming the nearest."""
    if name in ENGINES:
        return None
    near = difflib.get_close_matches(name, ENGINES, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return f"actor_rollout_ref.rollout.name={name!r} is not a rollout engine (one of {engine_names()}){hint}"


def _entry(name: str, what: str) -> Optional[Any]:
    reason = unknown_engine(name)
    if reason:
        raise ValueError(reason)
    target = ENGINES[name].get(what)
    if target is None:
        return None
    module, function = target.split(":")
    return getattr(importlib.import_module(module), function)


def deployment_modes(name: str) -> tuple[str, ...]:
    if unknown_engine(name):
        raise ValueError(unknown_engine(name))
    return tuple(ENGINES[name].get("modes", ("sync",)))


def deployment_mode(name: str, mode: Optional[str]) -> str:
    """rollout.mode resolved: `mode`, or the engine's default (its first); ValueError when it has no such mode."""
    modes = deployment_modes(name)
    if mode is None:
        return modes[0]
    if mode not in modes:
        raise ValueError(f"actor_rollout_ref.rollout.mode={mode!r}: the {name} engine runs as {' or '.join(modes)}")
    return mode


def sync_modes(name: str, mode: Optional[str] = None) -> tuple[str, ...]:
    """The weight transports (rollout.weight_sync) of engine `name` deployed as `mode` (None: its default)."""
    table = ENGINES[name]["sync_modes"] if not unknown_engine(name) else None
    if table is None:
        raise ValueError(unknown_engine(name))
    return tuple(table[deployment_mode(name, mode)] if isinstance(table, dict) else table)


def partial_rollout(name: str) -> bool:
    """Whether the engine's aborted generations keep their tokens (async_training.partial_rollout)."""
    return bool(ENGINES.get(name, {}).get("partial_rollout", False))


def multi_modal(name: str) -> bool:
    """Whether the engine's `generate` takes prompts' images (a vision-language actor)."""
    return bool(ENGINES.get(name, {}).get("multi_modal", False))


def routed_experts(name: str) -> bool:
    """Whether the engine returns each token's routed experts (`Completion.routed_experts`, router replay R3)."""
    return bool(ENGINES.get(name, {}).get("routed_experts", False))


def lora_adapters(name: str) -> tuple[str, ...]:
    """The devices on which the engine serves LoRA adapters by name (rollout.lora_sync=adapter); () when none."""
    return tuple(ENGINES.get(name, {}).get("lora_adapters", ()))


def lora_adapter_refusal(name: str, device: str) -> Optional[str]:
    """Why engine `name` cannot serve a LoRA actor's adapters on `device` (rollout.lora_sync=adapter), naming the
    fix; None when it can."""
    devices = lora_adapters(name)
    if not devices:
        return (f"needs an engine that serves LoRA adapters (rollout.name=vllm, or sglang on GPU), got {name!r}; "
                "use lora_sync=merged")
    if device in devices:
        return None
    from megappo.rollout.sglang.limits import SGLANG_CPU_LORA  # standard library only

    why = SGLANG_CPU_LORA if name == "sglang" else f"use trainer.device in {devices}"
    return f"the {name} engine serves adapters on {', '.join(devices)} only: {why}"


def deploy(settings: Any, ps: Any, platform: Any) -> Any:
    """The `RolloutDeployment` of engine `settings.name` (`megappo.rollout.settings.RolloutSettings`) over the
    trainer's ranks; collective."""
    return _entry(settings.name, "deploy")(settings, ps, platform)


def preflight(cfg: Any) -> list[str]:
    """The engine's reasons to refuse this run (a missing package, say); none: it may run."""
    check = _entry(cfg.actor_rollout_ref.rollout.name, "preflight")
    return list(check(cfg)) if check is not None else []
