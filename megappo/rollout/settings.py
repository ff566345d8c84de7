"""What a rollout engine's deployment reads: plain settings, built from the config tree by the trainer
(`megappo.trainer.settings.rollout_settings`), so no engine reads the tree. Every default is the config schema's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional


@dataclass(frozen=True)
class AdapterServing:
    """rollout.lora_sync=adapter: the servers serve the actor's LoRA adapters (SGLang's LoRA flags)."""

    rank: int
    target_modules: tuple[str, ...]  # megatron's linear layers (linear_qkv, linear_proj, linear_fc1, linear_fc2)


@dataclass(frozen=True)
class RolloutSettings:
    """The engine of `actor_rollout_ref.rollout.name` and how it is deployed; the server fields are SGLang's (the
    config's names, under actor_rollout_ref.rollout)."""

    name: str
    model_path: str  # the actor's Hugging Face directory
    trust_remote_code: bool
    seed: int  # data.seed: the in-process engine's sampling stream
    hybrid_engine: bool  # the in-process engine runs in the trainer's process (else in a child of its own)
    max_num_seqs: int
    engine_kwargs: Mapping[str, Any]
    dtype: Optional[str]
    tensor_model_parallel_size: int
    gpu_memory_utilization: float
    server_urls: tuple[str, ...]
    servers_per_node: Optional[int]
    server_python: Optional[str]
    server_host: str
    server_start_timeout_s: float
    request_timeout_s: float
    health_check_interval_s: float
    health_check_timeout_s: float
    restart_failed_servers: bool
    router: str
    router_policy: str
    router_python: Optional[str]
    api_key: Optional[str]
    api_key_file: Optional[str]
    sync_timeout_s: float
    weight_sync_master_address: Optional[str]
    lora_adapter: Optional[AdapterServing]  # None: the servers serve merged weights
    routed_experts: bool = False  # rollout.enable_rollout_routing_replay: completions carry MoE routes
    mode: str = "async"  # rollout.mode, resolved (`registry.deployment_mode`)
    enforce_eager: bool = False
    max_num_batched_tokens: Optional[int] = None
    max_model_len: Optional[int] = None
    free_cache_engine: bool = True
    # the servers' logs (the run's `servers/` folder: `serving.process.server_log_path`); None: temporary files,
    # kept only when something failed
    log_dir: Optional[str] = None


def refuse_unknown_kwargs(kwargs: Mapping[str, Any], accepted: Any, engine: str, fix: str) -> None:
    """Refuse `rollout.engine_kwargs` keys that `engine` does not take (ValueError naming them and `fix`)."""
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ValueError(f"actor_rollout_ref.rollout.engine_kwargs: {unknown} are not arguments of {engine}; {fix}")
