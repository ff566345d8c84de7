"""SGLang's servers of a run: what server i on port p is (its flags, LoRA flags, GPUs), sglang-router in front of
them with `rollout.router: sglang`, all held by the engine-neutral `ServerSet` (serving/server_set.py)."""
from __future__ import annotations

import sys
from typing import Optional

from megappo.platform.device import Platform
from megappo.rollout.serving.server_set import ServerSet
from megappo.rollout.settings import RolloutSettings
from megappo.rollout.sglang.health import is_healthy
from megappo.rollout.sglang.server import SGLangServer


def sglang_server_set(settings: RolloutSettings, platform: Platform, server_kwargs: dict) -> ServerSet:
    """The run's SGLang servers (not started): `server_kwargs` are SGLangServer's (`deploy.server_kwargs`)."""
    r = settings
    python = r.server_python or sys.executable
    lora_args = lora_server_args(r, platform)  # refused here (on CPU) before any server starts

    def server(index: int, port: Optional[int], api_key: str) -> SGLangServer:
        base = server_kwargs.get("port")  # engine_kwargs.port: the node's first server's, the next ones follow
        kwargs = dict(server_kwargs, api_key=api_key, port=port or (base + index if base else None))
        extra = list(kwargs.pop("extra_args", [])) + lora_args
        if platform.is_cuda:
            tp = r.tensor_model_parallel_size
            extra += ["--tp", str(tp), "--base-gpu-id", str(index * tp),
                      "--mem-fraction-static", str(r.gpu_memory_utilization)]
        return SGLangServer(r.model_path, python=python, cuda=platform.is_cuda, extra_args=extra, **kwargs)

    def router(live: list[str], api_key: str):
        from megappo.rollout.sglang.router import SGLangRouter

        # on rollout.server_host, like the servers: holders on other nodes send their requests there
        return SGLangRouter(live, python=r.router_python or python, api_key=api_key, host=r.server_host,
                            policy=r.router_policy, health_check_interval_s=r.health_check_interval_s,
                            health_check_timeout_s=r.health_check_timeout_s, request_timeout_s=r.request_timeout_s)

    return ServerSet(r, platform, server, healthy=is_healthy,
                     engine="SGLang", router=router if r.router == "sglang" else None)


def lora_server_args(settings: RolloutSettings, platform: Platform) -> list[str]:
    """SGLang's LoRA flags for rollout.lora_sync=adapter: the adapter's rank, the HF linear layers it targets (the
    names `megappo.convert.peft_io` writes), room for two adapters (the new one loads before the old one unloads).
    Refused on CPU (`SGLANG_CPU_LORA`)."""
    adapter = settings.lora_adapter
    if adapter is None:
        return []
    if not platform.is_cuda:
        from megappo.rollout.sglang.limits import SGLANG_CPU_LORA

        raise ValueError(f"actor_rollout_ref.rollout.lora_sync=adapter: {SGLANG_CPU_LORA}")
    targets = sorted({hf for t in adapter.target_modules for hf in LORA_HF_TARGETS[t]})
    return ["--enable-lora", "--max-lora-rank", str(adapter.rank), "--lora-target-modules", *targets,
            "--max-loras-per-batch", "2"]


# megatron's fused linear layers -> the HF linear layers PEFT (and SGLang) name (megappo.convert.mapping)
LORA_HF_TARGETS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                   "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
