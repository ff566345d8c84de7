"""The config's rules of the advantage estimator and the policy loss (`algorithm.adv_estimator`,
`actor.policy_loss`), asked of their registries; each message names the key, what is wrong and the fix. The loss's
own refusals ask the same functions (`policy_losses.dro_beta_refusal`). `megappo.checks` runs them with the rest."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

P = "actor_rollout_ref.actor"


def _need(errors: list[str], ok: bool, key: str, problem: str, fix: str) -> None:
    if not ok:
        errors.append(f"{key}: {problem}; {fix}")


def algorithm_errors(cfg, check_files: bool = False) -> list[str]:
    """Every rule of the estimator, the policy loss and its token choice."""
    errors: list[str] = []
    _check_estimator(cfg, errors)
    _check_policy_loss(cfg, errors)
    _check_token_choice(cfg, errors)
    return errors


def _custom_file(errors: list[str], key: str, path: Optional[str], name: Optional[str], selected: bool,
                 selector: str) -> None:
    if path is None:
        return
    named = bool(name) and str(name).isidentifier()
    _need(errors, named, f"{key}.name", "is not set" if name is None else f"'{name}' is not a Python name",
          f"set {key}.name to the function's name in {path}, and {selector} to that same name")
    _need(errors, Path(os.path.expanduser(path)).is_file(), f"{key}.path", f"'{path}' is not a file",
          "point it at the .py file that defines the function")
    if named:  # without a name there is nothing to select yet; the message above says what to set
        _need(errors, selected, selector, f"does not name {key}.name '{name}'", f"set {selector}={name} to use it")


def _check_estimator(cfg, errors: list[str]) -> None:
    from megappo.algos.estimators import get_adv_estimator

    alg, key = cfg.algorithm, "algorithm.adv_estimator"
    custom = alg.custom_adv_estimator
    _custom_file(errors, "algorithm.custom_adv_estimator", custom.path, custom.name,
                 alg.adv_estimator == custom.name, key)
    try:
        spec = get_adv_estimator(alg.adv_estimator, custom.path, custom.name)
    except (ValueError, OSError, SyntaxError, ImportError) as e:
        errors.append(f"{key}: {e}")
        return
    name, n = spec.name, cfg.actor_rollout_ref.rollout.n
    _need(errors, not spec.needs_groups or n > 1, "actor_rollout_ref.rollout.n",
          f"is {n} but algorithm.adv_estimator={name} compares responses within a prompt's group",
          "set actor_rollout_ref.rollout.n to 2 or more (e.g. 5)")
    critic_on = cfg.critic.enable
    if spec.needs_critic:
        _need(errors, critic_on is not False, "critic.enable", f"is false but algorithm.adv_estimator={name} needs a "
              "value function", "set critic.enable=true, or use algorithm.adv_estimator=grpo")
    else:
        _need(errors, not critic_on, "critic.enable", f"is true but algorithm.adv_estimator={name} "
              "does not use a critic", "set critic.enable=false (or leave it unset)")
    if spec.needs_reward_components:
        keys, weights = alg.gdpo_reward_keys, alg.gdpo_reward_weights
        _need(errors, bool(keys), "algorithm.gdpo_reward_keys", f"is {keys} but algorithm.adv_estimator={name} "
              "normalises each reward component the reward function returns", "list the keys of the dict your "
              "reward function returns, e.g. [format_reward,accuracy_reward]")
        _need(errors, not keys or weights is None or len(weights) == len(keys), "algorithm.gdpo_reward_weights",
              f"has {len(weights or [])} weights for {len(keys or [])} gdpo_reward_keys", "give one per key, or null")
        _need(errors, not cfg.reward_model.enable, "reward_model.enable", f"is true but algorithm.adv_estimator="
              f"{name} reads the reward components of the rule reward function", "use a rule reward")
    if spec.needs_sum_pi_squared:
        _need(errors, not alg.rollout_correction.bypass_mode, "algorithm.rollout_correction.bypass_mode",
              f"is true but algorithm.adv_estimator={name} needs the old policy's sum over the vocabulary of pi^2 "
              "at every response token, which comes from the old log-prob forward that bypass_mode skips (it takes "
              "the rollout's log-probs as old)", "use a decoupled_* preset or bypass_mode=false, or "
              "algorithm.adv_estimator=grpo")
    if spec.needs_greedy_baseline:
        _need(errors, cfg.async_training.mode == "sync", "async_training.mode",
              f"is {cfg.async_training.mode} but algorithm.adv_estimator={name} scores a greedy response of the "
              "policy that sampled the step", "use async_training.mode=sync")
        _need(errors, not cfg.reward_model.enable, "reward_model.enable", f"is true but algorithm.adv_estimator="
              f"{name}'s greedy baselines are scored by the rule reward",
              "use a rule reward (reward_model.enable=false)")


def _check_policy_loss(cfg, errors: list[str]) -> None:
    from megappo.algos.policy_losses import dro_beta_refusal, get_policy_loss

    a, p = cfg.actor_rollout_ref.actor, P
    pl = a.policy_loss
    _custom_file(errors, f"{p}.policy_loss", pl.path, pl.name, pl.loss_mode == pl.name, f"{p}.policy_loss.loss_mode")
    try:
        get_policy_loss(pl.loss_mode, pl.path, pl.name)
    except (ValueError, OSError, SyntaxError, ImportError) as e:
        errors.append(f"{p}.policy_loss.loss_mode: {e}")
    for key in ("clip_cov_ratio", "kl_cov_ratio"):
        _need(errors, getattr(pl, key) > 0, f"{p}.policy_loss.{key}", f"must be > 0, got {getattr(pl, key)}",
              "use e.g. 0.0002")
    _need(errors, pl.clip_cov_lb < pl.clip_cov_ub, f"{p}.policy_loss.clip_cov_lb",
          f"{pl.clip_cov_lb} is not below clip_cov_ub {pl.clip_cov_ub}", "use e.g. 1.0 and 5.0")
    for key in ("tau_pos", "tau_neg"):
        _need(errors, getattr(a, key) > 0, f"{p}.{key}", f"must be > 0, got {getattr(a, key)}", "use 1.0 / 1.05")
    _need(errors, a.loss_scale_factor is None or a.loss_scale_factor > 0, f"{p}.loss_scale_factor",
          f"must be > 0 or null, got {a.loss_scale_factor}", "use null for data.max_response_length")
    _need(errors, pl.loss_mode != "sapo" or a.loss_agg_mode == "seq-mean-token-mean", f"{p}.loss_agg_mode",
          f"is {a.loss_agg_mode} but policy_loss.loss_mode=sapo always aggregates seq-mean-token-mean (as verl's "
          "sapo does, whatever loss_agg_mode says)", f"set {p}.loss_agg_mode=seq-mean-token-mean with sapo")
    if pl.loss_mode == "dro" and (refusal := dro_beta_refusal(pl.dro_beta)):
        errors.append(refusal)
    bypass = cfg.algorithm.rollout_correction.bypass_mode
    _need(errors, not bypass or pl.loss_mode == "vanilla", f"{p}.policy_loss.loss_mode",
          f"is {pl.loss_mode} but algorithm.rollout_correction.bypass_mode=true uses its own loss (loss_type)",
          "use loss_mode=vanilla with bypass_mode, or bypass_mode=false")


def _check_token_choice(cfg, errors: list[str]) -> None:
    """actor.policy_loss.top_entropy_quantile: which tokens the loss keeps."""
    key = f"{P}.policy_loss.top_entropy_quantile"
    pl, bypass = cfg.actor_rollout_ref.actor.policy_loss, cfg.algorithm.rollout_correction.bypass_mode
    q = pl.top_entropy_quantile
    _need(errors, 0 < q <= 1, key, f"must be in (0, 1], got {q}",
          "use e.g. 0.2 for the top 20% of tokens by entropy, or 1.0 for all")
    if q < 1:
        _need(errors, pl.loss_mode != "geo_mean", key, f"is {q} but loss_mode=geo_mean makes one term of each "
              "response (its ratios' geometric mean), so no token can be left out",
              "use 1.0 with geo_mean, or a token-level loss_mode such as vanilla")
        _need(errors, not bypass, key, f"is {q} but tokens are chosen by the old policy's entropy, from the old "
              "log-prob forward that algorithm.rollout_correction.bypass_mode skips",
              "use 1.0 with bypass_mode, or bypass_mode=false")
