"""Advantage estimators by name (``algorithm.adv_estimator``), verl 0.9.1's set and semantics.

A pure module like ``megappo.algos``: tensors in, tensors out. Two kinds of estimator, so the trainer can run each
on data-parallel shards without knowing its name:

- ``outcome``: ``fn(scores [N], group_ids [N], lengths [N], params) -> advantages [N]``, one number per response
  from its sequence score. The trainer gathers the step's scores from every rank first (groups of a prompt may be
  spread over ranks), so the function sees the whole step. The token advantages and returns are
  ``advantages[:, None] * mask``; with ``whiten_tokens`` those are further whitened over the step's tokens. With
  ``needs_reward_components`` (gdpo) scores is [K, N], one row per reward component instead of the summed score.
- ``token``: ``fn(token_rewards [B, T], mask [B, T], values [B, T] | None, baselines [B] | None, params,
  sum_across) -> (advantages [B, T], returns [B, T])`` on this rank's rows; batch statistics go through
  ``sum_across`` (see ``masked_whiten``).

``Estimator.needs_critic`` / ``needs_groups`` (rollout.n > 1) / ``needs_greedy_baseline`` (ReMax's greedy response
per prompt, scored, as ``baselines``) / ``needs_reward_components`` / ``needs_sum_pi_squared`` (the optimal token
baselines, ``token_baselines``) are what the config's derived defaults, its validation and the trainer read.
A user's estimator registers from a file: ``algorithm.custom_adv_estimator.{path,name}`` (see ``load_custom``).
"""
from __future__ import annotations

import difflib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch

from megappo.algos import _reverse_linear_scan, compute_gae, compute_grpo_advantages, masked_whiten
from megappo.algos.token_baselines import optimal_token_baseline, tir_optimal_token_baseline

__all__ = ["ADV_ESTIMATORS", "EstimatorParams", "Estimator", "adv_estimator", "get_adv_estimator",
           "load_custom", "register_adv_estimator", "suggest"]


@dataclass(frozen=True)
class EstimatorParams:
    """``algorithm.*`` values an estimator may read (mapped from the config in ``megappo.trainer.settings``)."""

    gamma: float
    lam: float
    norm_adv_by_std_in_grpo: bool
    gdpo_reward_weights: Optional[tuple[float, ...]]  # gdpo: one weight per reward component; None: all 1
    eps: float = 1e-6  # the std's guard in group normalisation


@dataclass(frozen=True)
class Estimator:
    name: str
    fn: Callable[..., Any]
    kind: Literal["outcome", "token"] = "outcome"
    needs_critic: bool = False
    needs_groups: bool = False
    needs_greedy_baseline: bool = False
    whiten_tokens: bool = False  # outcome only: whiten advantages[:, None] * mask over the step's tokens
    # gdpo: the outcome function gets [K, N] scores, one row per algorithm.gdpo_reward_keys component of the reward
    # function's result, instead of the summed [N] score
    needs_reward_components: bool = False
    # the optimal token baselines: the old policy's sum over the vocabulary of pi^2 per token [B, T], which the
    # trainer's old log-prob forward then computes too; fn(token_rewards, mask, group_ids, old_log_probs,
    # sum_pi_squared, *, is_weights) on the whole step's rows (megappo/algos/token_baselines.py)
    needs_sum_pi_squared: bool = False


ADV_ESTIMATORS: dict[str, Estimator] = {}


def adv_estimator(kind: Literal["outcome", "token"] = "outcome", *, needs_critic: bool = False,
                  needs_groups: bool = False, needs_greedy_baseline: bool = False, whiten_tokens: bool = False):
    """Mark a function as an estimator of `kind` with its needs (for a user's file; `load_custom` reads it)."""
    def mark(fn):
        fn.megappo_estimator = dict(kind=kind, needs_critic=needs_critic, needs_groups=needs_groups,
                                    needs_greedy_baseline=needs_greedy_baseline, whiten_tokens=whiten_tokens)
        return fn
    return mark


def register_adv_estimator(name: str, fn: Callable[..., Any], **needs: Any) -> Estimator:
    """Register `fn` under `name` (needs as in `adv_estimator`; defaults from the function's own marks)."""
    spec = Estimator(name, fn, **{**getattr(fn, "megappo_estimator", {}), **needs})
    old = ADV_ESTIMATORS.get(name)
    if old is not None and old.fn is not fn and getattr(old.fn, "__code__", None) is not getattr(fn, "__code__", 1):
        raise ValueError(f"an advantage estimator named {name!r} is already registered")
    ADV_ESTIMATORS[name] = spec
    return spec


def suggest(name: str, names) -> str:
    """'; did you mean X?' for the closest of `names`, or ''."""
    hint = difflib.get_close_matches(name, list(names), n=1, cutoff=0.4)
    return f"; did you mean '{hint[0]}'?" if hint else ""


def load_custom(path: str, name: str) -> Callable[..., Any]:
    """The function `name` of the Python file `path` (loaded once per path and modification time)."""
    full = os.path.abspath(os.path.expanduser(path))
    key = (full, os.path.getmtime(full))
    mod = _LOADED.get(key)
    if mod is None:
        spec = importlib.util.spec_from_file_location(f"megappo_custom_{abs(hash(key))}", full)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _LOADED[key] = mod
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise ValueError(f"{path} defines no function named {name!r}")
    return fn


_LOADED: dict[tuple[str, float], Any] = {}


def get_adv_estimator(name: str, custom_path: Optional[str] = None, custom_name: Optional[str] = None) -> Estimator:
    """The estimator `name`; a user's (`custom_path`'s function `custom_name`) is registered first when `name` is
    `custom_name`. ValueError naming the closest valid name when there is none."""
    if custom_path and name == custom_name and name not in ADV_ESTIMATORS:
        register_adv_estimator(name, load_custom(custom_path, custom_name))
    if name not in ADV_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}{suggest(name, ADV_ESTIMATORS)} "
                         f"(valid: {', '.join(ADV_ESTIMATORS)})")
    return ADV_ESTIMATORS[name]


# ----------------------------------------------------------------------------------------------------------------
# group statistics


def _groups(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    _, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, int(inverse.max()) + 1 if inverse.numel() else 0


def _group_sum(x: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
    return torch.zeros(k, dtype=x.dtype, device=x.device).index_add_(0, inverse, x)


def _group_mean(x: torch.Tensor, inverse: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean of each sample's group with 0 for groups of one, each sample's group size), both [N] float64."""
    x = x.double()
    count = _group_sum(torch.ones_like(x), inverse, k)
    mean = _group_sum(x, inverse, k) / count
    mean = torch.where(count < 2, torch.zeros_like(mean), mean)
    return mean[inverse], count[inverse]


def _out(adv: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return adv.to(like.dtype if like.dtype.is_floating_point else torch.float32)


# ----------------------------------------------------------------------------------------------------------------
# outcome estimators: scores [N] -> advantages [N]


def grpo(scores, group_ids, lengths, p: EstimatorParams) -> torch.Tensor:
    """(score - group mean) / (group std + eps) (Shao et al. 2024); Dr. GRPO without the std
    (norm_adv_by_std_in_grpo=false). Groups of one: the score itself."""
    return compute_grpo_advantages(scores, group_ids, eps=p.eps, norm_by_std=p.norm_adv_by_std_in_grpo)


def rloo(scores, group_ids, lengths, p: EstimatorParams) -> torch.Tensor:
    """Leave-one-out baseline (Ahmadian et al. 2024): score - mean of the other n - 1 = n/(n-1) (score - mean)."""
    inverse, k = _groups(group_ids)
    mean, n = _group_mean(scores, inverse, k)
    x = scores.double()
    adv = torch.where(n > 1, x * n / (n - 1).clamp_min(1) - mean * n / (n - 1).clamp_min(1), x)
    return _out(adv, scores)


def opo(scores, group_ids, lengths, p: EstimatorParams) -> torch.Tensor:
    """Optimal baseline (Hao et al. 2025): score - the group's length-weighted mean score."""
    inverse, k = _groups(group_ids)
    x, length = scores.double(), lengths.double()
    n = _group_sum(torch.ones_like(x), inverse, k)
    baseline = _group_sum(x * length, inverse, k) / _group_sum(length, inverse, k).clamp_min(1e-30)
    baseline = torch.where(n < 2, torch.zeros_like(baseline), baseline)
    return _out(x - baseline[inverse], scores)


def grpo_vectorized(scores, group_ids, lengths, p: EstimatorParams) -> torch.Tensor:
    """verl's vectorised GRPO as its trainer calls it: always divided by the group std (verl passes it no
    norm_adv_by_std_in_grpo, so that setting does not reach it)."""
    return compute_grpo_advantages(scores, group_ids, eps=p.eps, norm_by_std=True)


def rloo_vectorized(scores, group_ids, lengths, p: EstimatorParams) -> torch.Tensor:
    """verl's vectorised RLOO: as `rloo`, except that a response alone in its group gets 0, not its score."""
    inverse, k = _groups(group_ids)
    _, n = _group_mean(scores, inverse, k)
    return _out(torch.where(n > 1, rloo(scores, group_ids, lengths, p).double(), torch.zeros_like(n)), scores)


def gdpo(scores, group_ids, lengths, p: EstimatorParams) -> torch.Tensor:
    """GDPO (arXiv:2601.05242): each reward component normalised within its group as GRPO does, then the
    components' weighted sum (gdpo_reward_weights, default all 1), then whitened over the step's tokens. Always
    divided by the group std, as verl's trainer calls it (norm_adv_by_std_in_grpo does not reach it).

    scores: [K, N] (one row per component, algorithm.gdpo_reward_keys) or [N] (the sequence score alone, verl's
    fallback: GRPO whitened over tokens). Returns [N]."""
    comps = scores.unsqueeze(0) if scores.dim() == 1 else scores
    weights = p.gdpo_reward_weights or (1.0,) * comps.shape[0]
    if len(weights) != comps.shape[0]:
        raise ValueError(f"gdpo has {comps.shape[0]} reward components but {len(weights)} gdpo_reward_weights")
    total = sum(w * grpo_vectorized(c, group_ids, lengths, p).double() for w, c in zip(weights, comps, strict=True))
    return _out(total, comps)


def gpg(scores, group_ids, lengths, p: EstimatorParams) -> torch.Tensor:
    """GPG (Chu et al. 2025): alpha (score - group mean), alpha = N / (responses with a non-zero score)."""
    inverse, k = _groups(group_ids)
    mean, _ = _group_mean(scores, inverse, k)
    alpha = scores.numel() / max(int(torch.count_nonzero(scores)), 1)
    return _out(alpha * (scores.double() - mean), scores)


def grpo_passk(scores, group_ids, lengths, p: EstimatorParams) -> torch.Tensor:
    """Pass@k (Chen et al. 2025): only each group's best response gets an advantage, best - second best (divided
    by the group std + eps with norm_adv_by_std_in_grpo). Needs groups of two or more."""
    inverse, k = _groups(group_ids)
    adv = torch.zeros_like(scores, dtype=torch.float64)
    for g in range(k):
        rows = torch.nonzero(inverse == g).squeeze(1)
        if rows.numel() < 2:
            raise ValueError(f"grpo_passk needs at least 2 responses per prompt, a group has {rows.numel()}")
        r = scores[rows]
        top, idx = torch.topk(r, 2)  # ties: torch.topk's choice, as verl's
        value = (top[0] - top[1]).double()
        if p.norm_adv_by_std_in_grpo:
            value = value / (r.double().std() + p.eps)
        adv[rows[idx[0]]] = value
    return _out(adv, scores)


def reinforce_plus_plus_baseline(scores, group_ids, lengths, p: EstimatorParams) -> torch.Tensor:
    """REINFORCE++ with baseline (Hu 2025): score - group mean, then whitened over the step's tokens."""
    inverse, k = _groups(group_ids)
    mean, _ = _group_mean(scores, inverse, k)
    return _out(scores.double() - mean, scores)


# ----------------------------------------------------------------------------------------------------------------
# token estimators: token rewards [B, T] -> (advantages, returns) [B, T]


def gae(token_rewards, mask, values, baselines, p: EstimatorParams, sum_across=None):
    """GAE (`compute_gae`) with its advantages whitened over the step's tokens."""
    adv, returns = compute_gae(token_rewards, values, mask, gamma=p.gamma, lam=p.lam)
    return masked_whiten(adv, mask, sum_across=sum_across), returns


def reinforce_plus_plus(token_rewards, mask, values, baselines, p: EstimatorParams, sum_across=None):
    """REINFORCE++ (Hu 2025): discounted return-to-go over the valid tokens (masked ones carry it through),
    whitened over the step's tokens.

    The scan runs in float64 and is cast back: in float32 its log2(T) rounds of products lose more than a
    sequential loop does (at 2,048 tokens ~1e-5 of a return of ~30, against the float32 rounding's ~1e-6), and
    gamma itself is taken as float64 (0.999 rounded to float32 is off by 5e-8 a token, compounding over the row)."""
    m = mask.bool()
    dtype = torch.promote_types(token_rewards.dtype, torch.float32)
    r = token_rewards.to(torch.float64)
    a = torch.where(m, torch.full_like(r, p.gamma), torch.ones_like(r))
    returns = (_reverse_linear_scan(a, torch.where(m, r, torch.zeros_like(r))) * m).to(dtype)
    return masked_whiten(returns, m, sum_across=sum_across) * m, returns


def remax(token_rewards, mask, values, baselines, p: EstimatorParams, sum_across=None):
    """ReMax (Li et al. 2023): return-to-go minus the score of the prompt's greedy response (`baselines` [B])."""
    m = mask.to(token_rewards.dtype)
    returns = (token_rewards * m).flip(-1).cumsum(-1).flip(-1)
    return returns - baselines.to(returns.dtype).unsqueeze(-1) * m, returns


for _name, _fn, _needs in (
    ("gae", gae, dict(kind="token", needs_critic=True)),
    ("grpo", grpo, dict(needs_groups=True)),
    ("rloo", rloo, dict(needs_groups=True)),
    ("reinforce_plus_plus", reinforce_plus_plus, dict(kind="token")),
    ("reinforce_plus_plus_baseline", reinforce_plus_plus_baseline, dict(needs_groups=True, whiten_tokens=True)),
    ("remax", remax, dict(kind="token", needs_greedy_baseline=True)),
    ("opo", opo, dict(needs_groups=True)),
    ("gpg", gpg, dict(needs_groups=True)),
    ("grpo_passk", grpo_passk, dict(needs_groups=True)),
    ("grpo_vectorized", grpo_vectorized, dict(needs_groups=True)),
    ("rloo_vectorized", rloo_vectorized, dict(needs_groups=True)),
    ("gdpo", gdpo, dict(needs_groups=True, whiten_tokens=True, needs_reward_components=True)),
    ("optimal_token_baseline", optimal_token_baseline, dict(kind="token", needs_groups=True,
                                                            needs_sum_pi_squared=True)),
    ("tir_optimal_token_baseline", tir_optimal_token_baseline, dict(kind="token", needs_groups=True,
                                                                    needs_sum_pi_squared=True)),
):
    register_adv_estimator(_name, _fn, **_needs)


def compute_advantages(spec: Estimator, token_rewards: torch.Tensor, mask: torch.Tensor, p: EstimatorParams, *,
                       values: Optional[torch.Tensor] = None, baselines: Optional[torch.Tensor] = None,
                       group_ids: Optional[torch.Tensor] = None, sum_across=None,
                       old_log_probs: Optional[torch.Tensor] = None, sum_pi_squared: Optional[torch.Tensor] = None,
                       is_weights: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Any estimator on one whole batch (no data parallelism): token_rewards, mask [B, T] -> (advantages, returns)
    [B, T], both zero on masked positions. The trainer's phase does the same with the scores of every rank.
    old_log_probs, sum_pi_squared, is_weights [B, T]: the optimal token baselines' inputs (`token_baselines`)."""
    if spec.needs_sum_pi_squared:
        if old_log_probs is None or sum_pi_squared is None:
            raise ValueError(f"{spec.name} needs old_log_probs and sum_pi_squared")
        adv, ret = spec.fn(token_rewards, mask, group_ids, old_log_probs, sum_pi_squared, is_weights=is_weights)
        return adv * mask, ret * mask
    if spec.kind == "token":
        adv, ret = spec.fn(token_rewards, mask, values, baselines, p, sum_across)
        return adv * mask, ret * mask
    seq = spec.fn(token_rewards.sum(-1), group_ids, mask.sum(-1), p)
    return outcome_to_tokens(spec, seq, mask, sum_across)


def outcome_to_tokens(spec: Estimator, seq_adv: torch.Tensor, mask: torch.Tensor, sum_across=None):
    """An outcome estimator's [B] advantages as token (advantages, returns) [B, T]."""
    adv = seq_adv.unsqueeze(-1) * mask
    if spec.whiten_tokens:
        adv = masked_whiten(adv, mask, sum_across=sum_across) * mask
    return adv, adv.clone()
