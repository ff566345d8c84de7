"""The config's rules of the micro-batch layouts (prefix sharing), asked of the same functions the step's refusals
ask (`megappo.models.layout`); reads the tree alone (no torch). `megappo.checks` runs them with the rest."""
from __future__ import annotations

from megappo.models.layout import prefix_sharing_refusal


def layout_errors(cfg, check_files: bool = False) -> list[str]:
    """use_prefix_sharing=true on a model whose micro-batches cannot share (None decides by itself); the critic
    replays no routes."""
    meg = cfg.actor_rollout_ref.actor.megatron
    replay = meg.router_replay.mode != "disabled"
    errors = []
    for prefix, model, replaying in (("actor_rollout_ref.model", cfg.actor_rollout_ref.model, replay),
                                     ("critic.model", cfg.critic.model, False)):
        refusal = prefix_sharing_refusal(bool(model.use_remove_padding), meg.context_parallel_size, replaying, prefix)
        if model.use_prefix_sharing and refusal:
            errors.append(f"{prefix}.use_prefix_sharing: is true but {refusal}")
    return errors
