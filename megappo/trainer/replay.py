"""MoE router replay in the trainer (`actor_rollout_ref.actor.megatron.router_replay.mode`, verl's R2 / R3): the
one object the phases ask, chosen once from the config at setup (`Replay.of`).

R3: the engine's routes (`Samples.routed_experts`, asked for with rollout.enable_rollout_routing_replay) ride on
the experience's batch (`ModelBatch.routes`), so the reference pass, the old log-probs and every update replay them
(the forward step does, `megappo.models.router_replay`). R2: the old-log-prob pass records the actor's own routes
and the update replays those (the reference pass, which runs before it, routes freely).

Each step logs `rollout/router_agreement`: in R3 the fraction of the old-log-prob pass's routes (token x MoE layer,
the last token's and padding aside) where the actor's own top-k equals the engine's it replays; the log-prob gap
between engine and trainer is `rollout/logprob_diff_mean` (`phases.old_log_probs`).
"""
from __future__ import annotations

from typing import Any

from megappo.models import router_replay
from megappo.parallel import reduce_over_ranks

KEY = "actor_rollout_ref.actor.megatron.router_replay.mode"


class Replay:
    """The run's router replay (mode disabled: every call is a no-op)."""

    def __init__(self, mode: str, roles):
        self.mode = mode
        if mode == "disabled":
            return
        self.actor = roles.actor.chunks
        if not router_replay.install(self.actor):
            raise ValueError(f"{KEY}={mode}: the actor is a dense model (no MoE layers), so it has no routes to "
                             f"replay; set {KEY}=disabled")
        if roles.ref is not None:
            router_replay.install(roles.ref.chunks)

    @classmethod
    def of(cls, cfg, roles) -> "Replay":
        return cls(cfg.actor_rollout_ref.actor.megatron.router_replay.mode, roles)

    def place(self, samples: Any, exp: Any) -> None:
        """R3: the engine's routes of this rank's samples onto its batch."""
        if self.mode == "R3":
            missing = [i for i in exp.indices if samples.routed_experts[i] is None and samples.response_ids[i]]
            if missing:
                raise RuntimeError(f"{KEY}=R3: {len(missing)} samples came back from the rollout engine without "
                                   "routed experts (an SGLang server needs --enable-return-routed-experts)")
            exp.batch.routes = router_replay.batch_routes([samples.routed_experts[i] for i in exp.indices],
                                                          exp.batch)

    def before_old_log_probs(self) -> None:
        if self.mode == "disabled":
            return
        router_replay.reset_agreement(self.actor)
        router_replay.set_recording(self.actor, self.mode == "R2")

    def after_old_log_probs(self, exp: Any) -> dict[str, float]:
        if self.mode == "disabled":
            return {}
        if self.mode == "R2":
            exp.batch.routes = router_replay.take_recorded(self.actor)
            return {}
        agree, total = reduce_over_ranks(list(router_replay.agreement(self.actor)))
        return {"rollout/router_agreement": agree / max(total, 1)}
