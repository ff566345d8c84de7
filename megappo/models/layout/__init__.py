"""A micro-batch's layout: padded rows, one pack of its sequences (THD), or this context-parallel rank's chunks.

Everything that differs between the layouts lives here: the plan that picks the layout once per step and lays out
each micro-batch (`plan`), the packing math (`packing`), prefix sharing's trees of a prompt and its responses
(`prefix`), the context-parallel split and gathers (`context_parallel`), and how megappo's SDPAttention attends in
each layout (`attention`). The forward step, the
loss closures and the attention ask the layout; none of them tests which one it is.
"""


def prefix_sharing_refusal(packed: bool, cp_size: int, replaying: bool,
                           model: str = "actor_rollout_ref.model") -> "str | None":
    """Why a model's micro-batches cannot share prompts (`model.use_prefix_sharing`), or None: sharing runs packs, or
    tree rows under context parallelism, and router replay (`replaying`) lays its routes out per row
    (`router_replay.token_sources`), not per shared tree. The config's rule and the step's refusal both ask it."""
    if replaying:
        return (f"prefix sharing does not run with MoE router replay (replayed routes are laid out per row): set "
                f"{model}.use_prefix_sharing=false or actor_rollout_ref.actor.megatron.router_replay.mode=disabled")
    if not packed and cp_size <= 1:
        return ("prefix sharing runs packed micro-batches (or context-parallel ones): set "
                f"{model}.use_remove_padding=true (or use_prefix_sharing=false)")
    return None


def per_position_topk_refusal(megatron) -> "str | None":
    """Why a run's micro-batch layouts cannot give per-position top-k outputs (top-k logit distillation), or None.
    megatron: the actor's `MegatronConfig`. Context-parallel chunks gather per-token scalars only."""
    if megatron.context_parallel_size > 1:
        return ("is not computed under context parallelism (its ranks gather per-token scalars only): set "
                "context_parallel_size=1 or use loss_mode=k3")
    return None
