"""The config's rules of MoE router replay (`actor_rollout_ref.actor.megatron.router_replay`, verl's keys); whether
the model is a MoE at all is checked where it is built (`megappo.trainer.replay`)."""
from __future__ import annotations

from megappo.config.schema import MegappoConfig

KEY = "actor_rollout_ref.actor.megatron.router_replay.mode"


def replay_errors(cfg: MegappoConfig) -> list[str]:
    from megappo.rollout.registry import routed_experts

    arr = cfg.actor_rollout_ref
    mode, rollout = arr.actor.megatron.router_replay.mode, arr.rollout
    errors = []
    for role, meg in (("actor_rollout_ref.ref", arr.ref.megatron), ("critic", cfg.critic.megatron)):
        if meg.router_replay.mode != "disabled":
            errors.append(f"{role}.megatron.router_replay.mode={meg.router_replay.mode}: the reference replays what "
                          f"the actor's mode gives it and a critic has no policy routes; set it to disabled and set "
                          f"{KEY} instead")
    if mode == "R3" and not rollout.enable_rollout_routing_replay:
        errors.append(f"{KEY}=R3 replays the rollout engine's routes, which it returns only when asked; set "
                      "actor_rollout_ref.rollout.enable_rollout_routing_replay=true (or use mode R2)")
    if rollout.enable_rollout_routing_replay and not routed_experts(rollout.name):
        errors.append(f"actor_rollout_ref.rollout.enable_rollout_routing_replay=true: the {rollout.name} engine "
                      "cannot return routed experts; set it to false and use mode R2 or disabled")
    return errors
