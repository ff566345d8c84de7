"""rollout.name=sglang over the trainer's ranks: servers started per node (or `rollout.server_urls`), one fleet
client per data-parallel replica, weights streamed by global rank 0 into every server at once.

Each replica's first rank (the holder) generates through an `SGLangFleet` over all the run's servers (itself, or
through sglang-router); global rank 0's fleet is the sync target. Before each sync, dead servers are restarted (or
dropped) collectively (`ServerSet.heal`, serving/server_set.py) and every client is told, so the sync that follows
gives a restarted server the current weights.

Light to import: the trainer's preflight calls `preflight` before torch is loaded.
"""
from __future__ import annotations

from typing import Any, Optional

from megappo.rollout.serving.deployment import ServedDeployment
from megappo.rollout.serving.probe import package_missing, server_problems
from megappo.rollout.settings import RolloutSettings, refuse_unknown_kwargs

SGLANG_INSTALL = 'pip install "megappo[sglang]"'
SGLANG_CPU_VENV = "bash tools/sglang/install_cpu.sh VENV"
SERVER_KWARGS = ("dtype", "max_total_tokens", "extra_args", "port", "host", "api_key")


def sglang_missing(python: str) -> Optional[str]:
    """Why `python` cannot run sglang (None when it can): `serving.probe.package_missing`."""
    return package_missing(python, "sglang")


def preflight(cfg: Any) -> list[str]:
    """The servers the trainer starts run on server_python: it must have SGLang; an API key file must hold a key;
    servers given by URL must take the run's key."""
    from megappo.rollout.sglang.server import SGLangServer

    return server_problems(cfg.actor_rollout_ref.rollout, "sglang", lambda python: sglang_missing(python),
                           SGLANG_INSTALL, SGLANG_CPU_VENV, SGLangServer.KEYED_PATH)


def server_kwargs(r: RolloutSettings, platform: Any) -> dict:
    """SGLangServer arguments: the rollout dtype, then `rollout.engine_kwargs` (dtype, max_total_tokens,
    extra_args: a list of further launch_server flags)."""
    from megappo.rollout.serving.server_set import configured_api_key

    dtype = r.dtype or str(platform.dtype).replace("torch.", "")
    refuse_unknown_kwargs(r.engine_kwargs, SERVER_KWARGS, "SGLangServer",
                          f"use {SERVER_KWARGS} (pass other launch_server flags as extra_args: [--flag, value])")
    kw = {"dtype": dtype, "trust_remote_code": r.trust_remote_code,
          "host": r.server_host, "api_key": configured_api_key(r), **r.engine_kwargs}
    if r.routed_experts:  # router replay R3: the servers return each token's experts
        kw["extra_args"] = [*kw.get("extra_args", []), "--enable-return-routed-experts"]
    return kw


def deploy(settings: RolloutSettings, ps: Any, platform: Any) -> ServedDeployment:
    """The run's SGLang servers and, on each replica's first rank, an `SGLangFleet` over them."""
    from megappo.rollout.routes import RouteLayout
    from megappo.rollout.sglang.fleet import SGLangFleet
    from megappo.rollout.sglang.server_set import sglang_server_set
    from megappo.rollout.sglang.vlm import image_token_id

    r = settings

    def fleet(servers: Any) -> SGLangFleet:
        return SGLangFleet(
            servers.urls, timeout=r.request_timeout_s, tp_size=r.tensor_model_parallel_size,
            engine_kwargs={"api_key": servers.api_key, "sync_timeout": r.sync_timeout_s,
                           "image_token_id": image_token_id(r.model_path),
                           "routes": RouteLayout.of(r.model_path) if r.routed_experts else None},
            master_address=r.weight_sync_master_address or r.server_host,
            backend="nccl" if platform.is_cuda else "gloo", router_url=servers.router_url,
            health_check_interval_s=r.health_check_interval_s, health_check_timeout_s=r.health_check_timeout_s)

    return ServedDeployment(sglang_server_set(r, platform, server_kwargs(r, platform)), fleet, ps)
