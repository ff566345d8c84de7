"""Policy losses by name (``actor_rollout_ref.actor.policy_loss.loss_mode``), verl 0.9.1's set and semantics.

Every loss has one signature::

    fn(log_probs, old_log_probs, advantages, mask, params, *, agg_mode, num_tokens=None, num_seqs=None,
       is_weights=None) -> (scalar loss, metrics)

log_probs, old_log_probs, advantages, mask, is_weights: [B, T]. ``num_tokens`` / ``num_seqs`` are the mini-batch's
global counts (see ``aggregate_loss``): with them the sum of the micro-batches' losses is the mini-batch's loss,
for the sequence-level losses (GSPO, GMPO, SAPO's seq-mean) too, since a sequence never straddles two
micro-batches. is_weights (rollout correction) multiply each token's loss before aggregation, as verl passes
``rollout_is_weights`` (GMPO: their per-sequence geometric mean). Metrics are detached token means of the batch:
``ppo_kl`` always, ``pg_clipfrac`` and ``pg_clipfrac_lower`` (0 where a loss has no such clip).

A user's loss registers from a file: ``actor_rollout_ref.actor.policy_loss.{path,name}``.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from megappo.algos import _as_bool, aggregate_loss, masked_mean, policy_loss
from megappo.algos.estimators import load_custom, suggest

__all__ = ["POLICY_LOSSES", "PolicyLossParams", "get_policy_loss", "register_policy_loss"]


@dataclass(frozen=True)
class PolicyLossParams:
    """The actor's loss settings (verl's names in ``actor`` and ``actor.policy_loss``)."""

    clip_low: float = 0.2  # clip_ratio_low
    clip_high: float = 0.2  # clip_ratio_high
    clip_c: Optional[float] = 3.0  # clip_ratio_c (vanilla's dual clip)
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    tau_pos: float = 1.0  # sapo
    tau_neg: float = 1.05
    norm_length: Optional[float] = None  # seq-mean-token-sum-norm's divisor (loss_scale_factor); None: T
    dro_beta: Optional[float] = None  # dro: the quadratic log-ratio penalty's coefficient (required, > 0)


PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str):
    def add(fn: PolicyLossFn) -> PolicyLossFn:
        POLICY_LOSSES[name] = fn
        return fn
    return add


def get_policy_loss(name: str, custom_path: Optional[str] = None, custom_name: Optional[str] = None) -> PolicyLossFn:
    """The loss `name`; a user's (`custom_path`'s function `custom_name`) is registered first when `name` is
    `custom_name`. ValueError naming the closest valid name when there is none."""
    if custom_path and name == custom_name and name not in POLICY_LOSSES:
        POLICY_LOSSES[name] = load_custom(custom_path, custom_name)
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss_mode {name!r}{suggest(name, POLICY_LOSSES)} "
                         f"(valid: {', '.join(POLICY_LOSSES)})")
    return POLICY_LOSSES[name]


def _zero(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=x.dtype, device=x.device)


def _prepare(log_probs, old_log_probs, advantages, mask, is_weights):
    """Masked positions zeroed up front: padding may hold -inf/NaN log-probs, and 0 * NaN in the backward pass
    would poison the valid tokens' gradients. Returns (bool mask, log_probs, old, advantages, is_weights)."""
    m = _as_bool(mask, log_probs)
    z = _zero(log_probs)
    lp = torch.where(m, log_probs, z)
    old = torch.where(m, old_log_probs.to(log_probs.dtype), z)
    adv = torch.where(m, advantages.to(log_probs.dtype), z)
    w = None if is_weights is None else torch.where(m, is_weights.detach().to(log_probs.dtype), z)
    return m, lp, old, adv, w


def _metrics(m, ppo_kl, clipfrac=None, clipfrac_lower=None):
    z = _zero(ppo_kl)
    return {"pg_clipfrac": (z if clipfrac is None else clipfrac).detach(),
            "pg_clipfrac_lower": (z if clipfrac_lower is None else clipfrac_lower).detach(),
            "ppo_kl": ppo_kl.detach()}


def _agg(losses, m, w, agg_mode, p: PolicyLossParams, num_tokens, num_seqs):
    if w is not None:
        losses = losses * w
    return aggregate_loss(losses, m, agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, norm_length=p.norm_length)


@register_policy_loss("vanilla")
def vanilla(log_probs, old_log_probs, advantages, mask, p: PolicyLossParams, *, agg_mode="token-mean",
            num_tokens=None, num_seqs=None, is_weights=None):
    """PPO's clipped surrogate with asymmetric clip and dual clip (`megappo.algos.policy_loss`)."""
    return policy_loss(log_probs, old_log_probs, advantages, mask, clip_low=p.clip_low, clip_high=p.clip_high,
                       clip_c=p.clip_c, agg_mode=agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                       is_weights=is_weights, norm_length=p.norm_length)


@register_policy_loss("gspo")
def gspo(log_probs, old_log_probs, advantages, mask, p: PolicyLossParams, *, agg_mode="token-mean",
         num_tokens=None, num_seqs=None, is_weights=None):
    """GSPO (Zheng et al. 2025): every token of a response clipped with the response's ratio
    s = exp(mean log-ratio), whose gradient flows through each token's log-prob (verl's token form)."""
    m, lp, old, adv, w = _prepare(log_probs, old_log_probs, advantages, mask, is_weights)
    log_ratio = lp - old
    seq_log_ratio = log_ratio.sum(-1) / m.sum(-1).clamp_min(1).to(lp.dtype)
    log_s = torch.clamp(lp - lp.detach() + seq_log_ratio.detach().unsqueeze(-1), max=10.0)
    s = torch.exp(log_s)
    unclipped = -adv * s
    clipped = -adv * torch.clamp(s, 1 - p.clip_low, 1 + p.clip_high)
    losses = torch.maximum(unclipped, clipped)
    loss = _agg(losses, m, w, agg_mode, p, num_tokens, num_seqs)
    return loss, _metrics(m, masked_mean(-log_ratio, m), masked_mean((clipped > unclipped).to(lp.dtype), m))


@register_policy_loss("cispo")
def cispo(log_probs, old_log_probs, advantages, mask, p: PolicyLossParams, *, agg_mode="token-mean",
          num_tokens=None, num_seqs=None, is_weights=None):
    """CISPO (MiniMax 2025): -sg(clip(ratio)) * A * log-prob; every token keeps a gradient."""
    m, lp, old, adv, w = _prepare(log_probs, old_log_probs, advantages, mask, is_weights)
    neg_kl = torch.clamp(lp - old, -20.0, 20.0)
    ratio = torch.exp(neg_kl)
    clipped = torch.clamp(ratio, 1 - p.clip_low, 1 + p.clip_high)
    losses = -clipped.detach() * adv * lp
    loss = _agg(losses, m, w, agg_mode, p, num_tokens, num_seqs)
    return loss, _metrics(m, masked_mean(-neg_kl, m), masked_mean((ratio != clipped).to(lp.dtype), m))


@register_policy_loss("sapo")
def sapo(log_probs, old_log_probs, advantages, mask, p: PolicyLossParams, *, agg_mode="token-mean",
         num_tokens=None, num_seqs=None, is_weights=None):
    """SAPO (Qwen 2025): a sigmoid gate 4/tau sigmoid(tau (r - 1)) instead of the hard clip, tau_pos for A > 0 and
    tau_neg otherwise. Always aggregated seq-mean-token-mean, as verl does, whatever loss_agg_mode says (the
    config's validation refuses any other loss_agg_mode with sapo, so the setting is never silently dropped)."""
    m, lp, old, adv, w = _prepare(log_probs, old_log_probs, advantages, mask, is_weights)
    neg_kl = torch.clamp(lp - old, -20.0, 20.0)
    ratio = torch.exp(neg_kl)
    tau = torch.where(adv > 0, torch.as_tensor(p.tau_pos, dtype=lp.dtype), torch.as_tensor(p.tau_neg, dtype=lp.dtype))
    gates = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss = _agg(-gates * adv, m, w, "seq-mean-token-mean", p, num_tokens, num_seqs)
    return loss, _metrics(m, masked_mean(-neg_kl, m))


@register_policy_loss("gpg")
def gpg(log_probs, old_log_probs, advantages, mask, p: PolicyLossParams, *, agg_mode="token-mean",
        num_tokens=None, num_seqs=None, is_weights=None):
    """GPG (Chu et al. 2025): plain policy gradient -A * log-prob, no ratio and no clip."""
    m, lp, old, adv, w = _prepare(log_probs, old_log_probs, advantages, mask, is_weights)
    loss = _agg(-lp * adv, m, w, agg_mode, p, num_tokens, num_seqs)
    return loss, _metrics(m, masked_mean(old - lp, m))


@register_policy_loss("clip_cov")
def clip_cov(log_probs, old_log_probs, advantages, mask, p: PolicyLossParams, *, agg_mode="token-mean",
             num_tokens=None, num_seqs=None, is_weights=None):
    """Clip-Cov (Cui et al. 2025): PPO's clipped loss, and the gradient of a random clip_cov_ratio of the
    micro-batch's unclipped tokens whose covariance (A - mean A)(logp - mean logp) lies in (clip_cov_lb,
    clip_cov_ub) is cut. The draw uses torch's global generator, as verl's."""
    if p.clip_cov_ratio <= 0:
        raise ValueError(f"clip_cov_ratio must be > 0, got {p.clip_cov_ratio}")
    m, lp, old, adv, w = _prepare(log_probs, old_log_probs, advantages, mask, is_weights)
    neg_kl = lp - old
    ratio = torch.exp(neg_kl)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - p.clip_low, 1 + p.clip_high)
    clip_by_origin = (clipped > unclipped) & m
    with torch.no_grad():
        cov = (adv - masked_mean(adv, m)) * (lp - masked_mean(lp, m))
        cov = cov.masked_fill(~m | clip_by_origin, -torch.inf)
        clip_num = max(int(p.clip_cov_ratio * int(m.sum())), 1)
        candidates = torch.nonzero((cov < p.clip_cov_ub) & (cov > p.clip_cov_lb) & m)
        if len(candidates) > 0:
            candidates = candidates[torch.randperm(len(candidates))[:min(clip_num, len(candidates))]]
        corr = torch.ones_like(adv)
        corr[candidates[:, 0], candidates[:, 1]] = 0
    losses = torch.maximum(unclipped, clipped) * corr
    loss = _agg(losses, m, w, agg_mode, p, num_tokens, num_seqs)
    return loss, _metrics(m, masked_mean(-neg_kl, m), masked_mean((corr == 0).to(lp.dtype), m))


@register_policy_loss("kl_cov")
def kl_cov(log_probs, old_log_probs, advantages, mask, p: PolicyLossParams, *, agg_mode="token-mean",
           num_tokens=None, num_seqs=None, is_weights=None):
    """KL-Cov (Cui et al. 2025): -A * ratio, plus ppo_kl_coef * |log-ratio| on the kl_cov_ratio of the
    micro-batch's tokens with the largest covariance (A - mean A)(logp - mean logp). ppo_kl is the mean |log-ratio|
    here, as in verl."""
    if p.kl_cov_ratio <= 0:
        raise ValueError(f"kl_cov_ratio must be > 0, got {p.kl_cov_ratio}")
    m, lp, old, adv, w = _prepare(log_probs, old_log_probs, advantages, mask, is_weights)
    neg_kl = lp - old
    ratio = torch.exp(neg_kl)
    losses = -adv * ratio
    n_valid = int(m.sum())
    if n_valid:
        with torch.no_grad():
            valid_adv, valid_lp = adv[m], lp[m]
            cov = (valid_adv - valid_adv.mean()) * (valid_lp - valid_lp.mean())
            top = torch.topk(cov, max(1, int(n_valid * p.kl_cov_ratio)), largest=True).indices
            flat = torch.nonzero(m.reshape(-1), as_tuple=True)[0][top]
            pick = torch.zeros(m.numel(), dtype=torch.bool, device=m.device)
            pick[flat] = True
        losses = torch.where(pick.view_as(m), losses + p.ppo_kl_coef * neg_kl.abs(), losses)
    loss = _agg(losses, m, w, agg_mode, p, num_tokens, num_seqs)
    return loss, _metrics(m, masked_mean(neg_kl.abs(), m))


@register_policy_loss("geo_mean")
def geo_mean(log_probs, old_log_probs, advantages, mask, p: PolicyLossParams, *, agg_mode="token-mean",
             num_tokens=None, num_seqs=None, is_weights=None):
    """GMPO (Zhao et al. 2025): -A_seq * the geometric mean of the response's clipped token ratios (clipped in
    log space, on the side of the advantage's sign), averaged over the sequences (num_seqs, every row counted, as
    verl's torch.mean); loss_agg_mode is not used. A_seq is the response's mean token advantage."""
    m, lp, old, adv, w = _prepare(log_probs, old_log_probs, advantages, mask, is_weights)
    neg_kl = lp - old
    sign = torch.sign(adv)
    neg_kl_clamp = torch.clamp(neg_kl, -p.clip_low, p.clip_high)
    neg_kl_min = sign * torch.minimum(sign * neg_kl, sign * neg_kl_clamp)
    length = m.sum(-1).to(lp.dtype)
    ratio = torch.exp(neg_kl_min.sum(-1) / (length + 1e-8))
    seq_adv = adv.sum(-1) / (length + 1e-8)
    losses = -seq_adv * ratio
    if w is not None:
        log_w = torch.where(m, torch.log(w + 1e-10), _zero(w))
        losses = losses * torch.exp(log_w.sum(-1) / (length + 1e-8))
    rows = torch.as_tensor(losses.shape[0] if num_seqs is None else num_seqs, dtype=lp.dtype)
    loss = torch.where(rows > 0, losses.sum() / rows.clamp_min(1), _zero(lp))
    clipped = (neg_kl != neg_kl_clamp).to(lp.dtype)
    return loss, _metrics(m, masked_mean(-neg_kl, m), masked_mean(clipped * (adv > 0), m),
                          masked_mean(clipped * (adv < 0), m))


def _dppo(log_probs, old_log_probs, advantages, mask, p: PolicyLossParams, agg_mode, num_tokens, num_seqs,
          is_weights, valid_fn):
    """DPPO's shared body: -A * sg(min(r, clip_c)) * log-prob on the tokens `valid_fn` keeps (a binary-divergence
    trust region on the sampled token's probability instead of PPO's ratio clip); clip_c 20 when None."""
    m, lp, old, adv, w = _prepare(log_probs, old_log_probs, advantages, mask, is_weights)
    neg_kl = torch.clamp(lp - old, -20.0, 20.0)
    ratio = torch.exp(neg_kl)
    clip_c = 20.0 if p.clip_c is None else p.clip_c
    truncated = torch.clamp(ratio, max=clip_c).detach()
    with torch.no_grad():
        valid = valid_fn(torch.exp(lp), torch.exp(old), lp, old, adv).to(lp.dtype)
    losses = -adv * truncated * lp * valid
    loss = _agg(losses, m, w, agg_mode, p, num_tokens, num_seqs)
    return loss, _metrics(m, masked_mean(-neg_kl, m), masked_mean(1.0 - valid, m),
                          masked_mean((ratio > clip_c).to(lp.dtype) * valid, m))


@register_policy_loss("dppo_tv")
def dppo_tv(log_probs, old_log_probs, advantages, mask, p: PolicyLossParams, *, agg_mode="token-mean",
            num_tokens=None, num_seqs=None, is_weights=None):
    """DPPO-Binary-TV (arXiv:2602.04879): a token keeps its gradient while its probability moved by at most
    clip_ratio_high up (A > 0) or clip_ratio_low down (A <= 0); clip_ratio_c truncates the detached ratio."""
    def valid(prob, old_prob, lp, old, adv):
        return torch.where(adv > 0, prob - old_prob <= p.clip_high, prob - old_prob >= -p.clip_low)
    return _dppo(log_probs, old_log_probs, advantages, mask, p, agg_mode, num_tokens, num_seqs, is_weights, valid)


@register_policy_loss("dppo_kl")
def dppo_kl(log_probs, old_log_probs, advantages, mask, p: PolicyLossParams, *, agg_mode="token-mean",
            num_tokens=None, num_seqs=None, is_weights=None):
    """DPPO-Binary-KL (arXiv:2602.04879): as dppo_tv with the binary KL of the sampled token's Bernoulli
    (old p, new p) as the divergence, bounded by clip_ratio_high (A > 0, probability up) or clip_ratio_low."""
    def valid(prob, old_prob, lp, old, adv):
        # 1e-8 keeps log finite when a probability reaches 1
        kl = old_prob * (old - lp) + (1 - old_prob) * torch.log((1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
        return torch.where(adv > 0, (kl <= p.clip_high) | (prob <= old_prob), (kl <= p.clip_low) | (prob >= old_prob))
    return _dppo(log_probs, old_log_probs, advantages, mask, p, agg_mode, num_tokens, num_seqs, is_weights, valid)


def dro_beta_refusal(dro_beta: Optional[float]) -> Optional[str]:
    """Why loss_mode=dro cannot run with `dro_beta` (its quadratic penalty's coefficient), or None; the config's
    rule (`megappo.algos.checks`) and the loss both ask it."""
    if dro_beta is not None and dro_beta > 0:
        return None
    return (f"actor_rollout_ref.actor.policy_loss.dro_beta: is {dro_beta} but policy_loss.loss_mode=dro needs a "
            "positive coefficient; set it, e.g. 0.1")


@register_policy_loss("dro")
def dro(log_probs, old_log_probs, advantages, mask, p: PolicyLossParams, *, agg_mode="token-mean",
        num_tokens=None, num_seqs=None, is_weights=None):
    """DRO (direct reward optimisation): -(A * log-prob - dro_beta / 2 * (log-prob - old)^2), no ratio and no
    clip; the quadratic term keeps the policy near the old one. Needs dro_beta > 0."""
    if refusal := dro_beta_refusal(p.dro_beta):
        raise ValueError(refusal)
    m, lp, old, adv, w = _prepare(log_probs, old_log_probs, advantages, mask, is_weights)
    log_ratio = lp - old
    losses = -(lp * adv - 0.5 * p.dro_beta * log_ratio.square())
    loss = _agg(losses, m, w, agg_mode, p, num_tokens, num_seqs)
    return loss, _metrics(m, masked_mean(-log_ratio, m))
