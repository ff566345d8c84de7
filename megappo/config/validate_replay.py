"""The config's rules of MoE router replay (`actor_rollout_ref.actor.megatron.router_replay`, verl's keys); whether
the model is a MoE at all is checked where it is built (`megappo.trainer.replay`), whether the engine returns routes
by the engine's rules (`megappo.rollout.checks`)."""
from __future__ import annotations

from megappo.config.schema import MegappoConfig

KEY = "actor_rollout_ref.actor.megatron.router_replay.mode"


def replay_errors(cfg: MegappoConfig, check_files: bool = False) -> list[str]:
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
    if mode == "R3" and (rollout.multi_turn.enable or rollout.agent.default_agent_loop
                         or rollout.agent.agent_loop_config_path):
        errors.append(f"{KEY}=R3: multi-turn and agent rollouts do not carry the engine's routes yet; use mode R2 "
                      "(the trainer's own routes) or disabled")
    if mode == "R2" and cfg.algorithm.rollout_correction.bypass_mode:
        errors.append(f"{KEY}=R2 records the routes in the old-log-prob pass, which "
                      "algorithm.rollout_correction.bypass_mode skips; use mode R3 or set bypass_mode=false")
    return errors
