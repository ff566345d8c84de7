"""The derived defaults: a field left None that follows another field, filled by `resolve` (the one place they live),
and the estimator's needs that some of them follow."""
from __future__ import annotations

from typing import Any

from megappo.config.schema import MegappoConfig, MegatronConfig

# the fields of `MegatronConfig` that make the parallel layout (shared by actor, reference and critic)
LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
               "expert_model_parallel_size", "expert_tensor_parallel_size", "context_parallel_size",
               "sequence_parallel")


def estimator(cfg: MegappoConfig):
    """`algorithm.adv_estimator`'s registry entry (a user's is loaded from custom_adv_estimator); ValueError if
    there is none."""
    from megappo.algos.estimators import get_adv_estimator

    alg = cfg.algorithm
    return get_adv_estimator(alg.adv_estimator, alg.custom_adv_estimator.path, alg.custom_adv_estimator.name)


def estimator_needs(cfg: MegappoConfig, need: str) -> bool:
    """Whether the estimator has `need` (needs_critic, needs_groups, needs_greedy_baseline); False for an unknown
    one (validation names it)."""
    try:
        return bool(getattr(estimator(cfg), need))
    except (ValueError, OSError):
        return False


def resolve(cfg: MegappoConfig) -> MegappoConfig:
    """Fill every derived default (a field left None that follows another field). Idempotent; returns cfg."""
    arr = cfg.actor_rollout_ref
    actor, ref, rollout, model = arr.actor, arr.ref, arr.rollout, arr.model
    if actor.clip_ratio_low is None:
        actor.clip_ratio_low = actor.clip_ratio
    if actor.clip_ratio_high is None:
        actor.clip_ratio_high = actor.clip_ratio
    if actor.data_loader_seed is None:
        actor.data_loader_seed = cfg.data.seed
    if model.tokenizer_path is None:
        model.tokenizer_path = model.path
    if model.use_remove_padding is None:
        model.use_remove_padding = True
    for follower in (cfg.critic.model, cfg.reward_model):
        if follower.use_remove_padding is None:
            follower.use_remove_padding = model.use_remove_padding
    if cfg.critic.model.use_prefix_sharing is None:
        cfg.critic.model.use_prefix_sharing = model.use_prefix_sharing
    if cfg.data.tokenizer is None:
        cfg.data.tokenizer = model.tokenizer_path
    if cfg.data.gen_batch_size is None:
        cfg.data.gen_batch_size = cfg.data.train_batch_size

    if rollout.prompt_length is None:
        rollout.prompt_length = cfg.data.max_prompt_length
    if rollout.response_length is None:
        rollout.response_length = cfg.data.max_response_length
    if rollout.dtype is None:
        rollout.dtype = model.dtype
    for log_prob in (rollout, ref):
        if log_prob.log_prob_use_dynamic_bsz is None:
            log_prob.log_prob_use_dynamic_bsz = actor.use_dynamic_bsz
        if log_prob.log_prob_max_token_len_per_gpu is None:
            log_prob.log_prob_max_token_len_per_gpu = actor.ppo_max_token_len_per_gpu

    critic = cfg.critic
    if critic.enable is None:
        critic.enable = estimator_needs(cfg, "needs_critic")
    # the critic's unset keys follow the actor's (its model, its batching) as verl's do
    _fill_unset(critic.model, path=model.path, tokenizer_path=model.tokenizer_path)
    _fill_unset(critic, ppo_mini_batch_size=actor.ppo_mini_batch_size, use_dynamic_bsz=actor.use_dynamic_bsz,
                forward_max_token_len_per_gpu=critic.ppo_max_token_len_per_gpu, ppo_epochs=actor.ppo_epochs,
                shuffle=actor.shuffle, loss_agg_mode=actor.loss_agg_mode)

    # While the megatron layer holds one parallel layout per process, the reference and the critic run in the
    # actor's: a size left at its default follows the actor's, and validation refuses one set to another value.
    defaults = MegatronConfig()
    for role in (ref.megatron, critic.megatron):
        for key in LAYOUT_KEYS:
            if getattr(role, key) == getattr(defaults, key):
                setattr(role, key, getattr(actor.megatron, key))

    t = cfg.trainer
    if t.default_local_dir is None:
        t.default_local_dir = f"checkpoints/{t.project_name}/{t.experiment_name}"
    return cfg


def _fill_unset(section: Any, **values: Any) -> None:
    """Set each of `section`'s keys that is None (unset) to the value given for it."""
    for key, value in values.items():
        if getattr(section, key) is None:
            setattr(section, key, value)
