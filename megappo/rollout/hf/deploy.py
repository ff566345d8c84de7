"""rollout.name=hf over the trainer's ranks: one engine per data-parallel replica, on its first rank, loaded from
the actor's Hugging Face directory; each holder loads the weights into its own engine. In the trainer's process
(actor_rollout_ref.hybrid_engine, the default: `HFEngine`), else in a process of its own beside it
(`HFProcessEngine`), which generates while the trainer trains (async_training)."""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from megappo.rollout.base import LocalDeployment
from megappo.rollout.hf.engine import HFEngine
from megappo.rollout.hf.process import HFProcessEngine
from megappo.rollout.settings import RolloutSettings, refuse_unknown_kwargs


def deploy(settings: RolloutSettings, ps: Any, platform: Any) -> LocalDeployment:
    if not settings.hybrid_engine:
        return deploy_process(settings, ps, platform)
    return LocalDeployment(
        dist.get_rank(ps.mp_group) == 0,
        lambda: HFEngine(settings.model_path, dtype=platform.dtype, device=platform.device,
                         max_num_seqs=settings.max_num_seqs, seed=settings.seed,
                         trust_remote_code=settings.trust_remote_code))


def deploy_process(settings: RolloutSettings, ps: Any, platform: Any) -> LocalDeployment:
    """One HFProcessEngine per data-parallel replica, on its first rank, with `rollout.engine_kwargs.threads`
    torch threads (default 1) in its child process."""
    kw = dict(settings.engine_kwargs)
    refuse_unknown_kwargs(kw, ("threads",), "the hf engine in its own process (actor_rollout_ref.hybrid_engine="
                          "false)", "it takes: threads")
    return LocalDeployment(
        dist.get_rank(ps.mp_group) == 0,
        lambda: HFProcessEngine(settings.model_path, threads=int(kw.get("threads", 1)), dtype=platform.dtype,
                                device=platform.device, max_num_seqs=settings.max_num_seqs, seed=settings.seed,
                                trust_remote_code=settings.trust_remote_code))
