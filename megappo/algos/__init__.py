"""PPO math: advantages, KL estimates, losses and KL controllers.

A pure module: tensors and numbers in, tensors (and a dict of detached metric tensors) out. Nothing here knows
about torch.distributed, megatron or the config tree, so users can compose these functions in their own loops.

Shapes are [B, T] (batch, response length) unless said otherwise. ``mask`` is 1 on response tokens and 0 on
padding / tokens that must not be trained on; any dtype (bool, int, float) is accepted. Masked positions never
contribute to a reduction, even when the tensor holds inf or NaN there.

Names and semantics follow verl's ``core_algos`` so recipes carry over: ``k1``/``k2``/``k3`` KL estimators,
``loss_agg_mode`` strings, dual-clip PPO with ``clip_ratio_c``, and the adaptive KL controller of Ziegler et al.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "AdaptiveKLController",
    "FixedKLController",
    "aggregate_loss",
    "apply_kl_penalty",
    "build_kl_controller",
    "compute_gae",
    "compute_grpo_advantages",
    "entropy_from_logits",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "policy_loss",
    "value_loss",
]

_BASE_KL_KINDS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
KL_KINDS = _BASE_KL_KINDS + tuple(k + "+" for k in _BASE_KL_KINDS)
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


# ----------------------------------------------------------------------------------------------------------------
# masked reductions


def _as_bool(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if mask.shape != like.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} must equal the tensor shape {tuple(like.shape)}")
    return mask.bool() if mask.dtype != torch.bool else mask


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` where ``mask`` is set. x, mask: same shape. Returns a scalar, or x reduced over ``dim``."""
    m = _as_bool(mask, x)
    # where, not x * mask: a masked inf/NaN (e.g. a log-prob of padding) must not poison the sum.
    xm = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return xm.sum() if dim is None else xm.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is set; 0 (not NaN) where nothing is set.

    x, mask: same shape. dim=None gives a scalar; otherwise x reduced over ``dim``.
    """
    total = masked_sum(x, mask, dim)
    count = _as_bool(mask, x).sum() if dim is None else _as_bool(mask, x).sum(dim)
    return total / count.clamp_min(1).to(total.dtype)


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    sum_across: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Normalise ``x`` to unit variance (and zero mean if ``shift_mean``) using statistics of the masked entries.

    x, mask: any shape, same shape. The variance is the unbiased (n - 1) masked variance, with eps 1e-8 inside the
    square root. Every position, masked or not, gets the same affine map so a masked position that carries a
    neighbour's value (see ``compute_gae``) stays equal to it. With fewer than two set entries the variance is
    undefined and the scale is left at 1 (only the mean shift applies), so degenerate batches never blow up.

    sum_across: when ``x`` is one shard of a larger batch (e.g. one data-parallel rank's), a function that sums a
    tensor of partial sums over every shard (an all-reduce); the statistics are then those of the whole batch.
    """
    m = _as_bool(mask, x)
    total = sum_across or (lambda t: t)
    n, x_sum = total(torch.stack([m.sum().to(x.dtype), masked_sum(x, m)])).unbind()
    mean = x_sum / n.clamp_min(1)
    centered = x - mean
    var = total(masked_sum(centered * centered, m)) / (n - 1).clamp_min(1)
    scale = torch.where(n >= 2, torch.rsqrt(var + 1e-8), torch.ones_like(var))
    whitened = centered * scale
    return whitened if shift_mean else whitened + mean


# ----------------------------------------------------------------------------------------------------------------
# advantages


def _reverse_linear_scan(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Solve y[t] = b[t] + a[t] * y[t + 1] with y[T] = 0, vectorised over the batch and time.

    a, b: [B, T]. Returns y: [B, T]. Hillis-Steele doubling: after the step with offset d, (a[t], b[t]) describe
    the map from y[t + 2d] to y[t]. ceil(log2 T) steps of O(B*T) tensor ops; unlike a cumsum in a rescaled space
    nothing is divided by a vanishing product of a, so float32 stays accurate for any gamma * lam.
    """
    T = a.shape[-1]
    a, b = a.clone(), b.clone()
    d = 1
    while d < T:
        # Positions t >= T - d already reach beyond the end (y = 0), so only the head [0, T - d) changes. The
        # right-hand sides read the old values in full before the slice assignment writes.
        new_b = torch.addcmul(b[:, :-d], a[:, :-d], b[:, d:])
        a[:, :-d] = a[:, :-d] * a[:, d:]
        b[:, :-d] = new_b
        d *= 2
    return b


@torch.no_grad()
def compute_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over response tokens.

    rewards, values, mask: [B, T]. Returns (advantages [B, T], returns [B, T]), advantages un-whitened and
    ``returns = advantages + values``.

    The recursion runs over the valid (mask = 1) positions of each row only: the value after the last valid token
    is 0, and a masked position carries the next valid position's value and advantage, so padding or observation
    tokens in the middle of a response are skipped as if absent. Rewards at masked positions are ignored.
    """
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must lie in [0, 1], got gamma={gamma}, lam={lam}")
    if rewards.shape != values.shape or rewards.dim() != 2:
        raise ValueError(f"rewards {tuple(rewards.shape)} and values {tuple(values.shape)} must both be [B, T]")
    m = _as_bool(mask, rewards)
    B, T = rewards.shape
    dtype = torch.promote_types(rewards.dtype, values.dtype)
    if not dtype.is_floating_point:
        dtype = torch.float32
    rewards, values = rewards.to(dtype), values.to(dtype)
    if T == 0:
        return rewards.clone(), values.clone()

    # Value of the next valid position strictly after t (index T = beyond the end, value 0): a reverse running
    # minimum over the indices of valid positions, shifted by one.
    pos = torch.arange(T, device=m.device).expand(B, T)
    valid_pos = torch.where(m, pos, torch.full_like(pos, T))
    next_incl = valid_pos.flip(1).cummin(1).values.flip(1)  # first valid index >= t
    next_strict = torch.cat([next_incl[:, 1:], torch.full_like(next_incl[:, :1], T)], dim=1)
    padded_values = torch.cat([values, values.new_zeros(B, 1)], dim=1)
    next_values = padded_values.gather(1, next_strict)

    zero = values.new_zeros(())
    delta = torch.where(m, rewards + gamma * next_values - values, zero)
    decay = gamma * lam
    if decay == 1.0:
        # Common case gamma = lam = 1: the advantage is the sum of the remaining valid TD errors.
        advantages = delta.flip(1).cumsum(1).flip(1)
    else:
        # Valid steps decay the carried advantage by gamma * lam; masked steps pass it through unchanged.
        a = torch.where(m, values.new_full((), decay), values.new_ones(()))
        advantages = _reverse_linear_scan(a, delta)
    return advantages, advantages + values


def compute_grpo_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor | Sequence[Any],
    *,
    eps: float = 1e-6,
    norm_by_std: bool = True,
) -> torch.Tensor:
    """Group-relative advantages (GRPO, Shao et al. 2024): each score against the other samples of its prompt.

    scores: [B] sequence scores. group_ids: [B] ints (tensor or list) or any hashable per sample (e.g. prompt
    uid strings); samples with equal ids form a group. Returns [B]:
    (score - group mean) / (group std + eps), the std unbiased; a group of one has mean 0 and std 1 so its
    advantage is its score (divided by 1 + eps when norm_by_std).
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be [B], got shape {tuple(scores.shape)}; reduce token scores with .sum(-1)")
    if len(group_ids) != scores.shape[0]:
        raise ValueError(f"group_ids has {len(group_ids)} entries but scores has {scores.shape[0]}")
    if isinstance(group_ids, torch.Tensor):
        _, inverse = torch.unique(group_ids, return_inverse=True)
    else:
        index: dict[Any, int] = {}
        inverse = torch.tensor([index.setdefault(g, len(index)) for g in group_ids], dtype=torch.long)
    inverse = inverse.to(scores.device)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0

    x = scores.to(torch.float64)  # group statistics in float64: scores are few, precision is free
    count = torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add_(0, inverse, torch.ones_like(x))
    total = torch.zeros_like(count).index_add_(0, inverse, x)
    mean = total / count
    sq_dev = torch.zeros_like(count).index_add_(0, inverse, (x - mean[inverse]) ** 2)
    std = (sq_dev / (count - 1).clamp_min(1)).sqrt()
    singleton = count < 2
    mean = torch.where(singleton, torch.zeros_like(mean), mean)
    std = torch.where(singleton, torch.ones_like(std), std)

    adv = x - mean[inverse]
    if norm_by_std:
        adv = adv / (std[inverse] + eps)
    return adv.to(scores.dtype if scores.dtype.is_floating_point else torch.float32)


# ----------------------------------------------------------------------------------------------------------------
# KL


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs (Schulman, "Approximating KL").

    log_probs, ref_log_probs: same shape. Returns that shape. Kinds: ``k1``/``kl`` logp - ref; ``abs``
    |logp - ref|; ``k2``/``mse`` (logp - ref)^2 / 2; ``k3``/``low_var_kl`` e^x - x - 1 with
    x = clamp(ref - logp, -20, 20), clamped to [-10, 10]. A ``+`` suffix (``k3+``) gives the base value forward and
    the gradient of ``k2`` backward: k2's gradient is the unbiased gradient of the KL, the others' are not.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL kind {kind!r}; valid kinds: {', '.join(KL_KINDS)}")
    if kind.endswith("+"):
        k2 = kl_penalty(log_probs, ref_log_probs, "k2")
        base = kl_penalty(log_probs, ref_log_probs, kind[:-1])
        return k2 + (base - k2).detach()
    diff = log_probs - ref_log_probs
    if kind in ("k1", "kl"):
        return diff
    if kind == "abs":
        return diff.abs()
    if kind in ("k2", "mse"):
        return 0.5 * diff.square()
    x = torch.clamp(-diff, min=-20.0, max=20.0)  # k3 / low_var_kl; clamps keep exp finite for extreme ratios
    return torch.clamp(torch.exp(x) - x - 1.0, min=-10.0, max=10.0)


def apply_kl_penalty(
    token_scores: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_coef: float,
    kind: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Subtract the KL penalty from token rewards (``algorithm.use_kl_in_reward``).

    token_scores, old_log_probs, ref_log_probs, mask: [B, T]. Returns (token_rewards [B, T], mean_kl scalar):
    token_rewards = token_scores - kl_coef * kl at response tokens (unchanged elsewhere); mean_kl, detached, is the
    mean over sequences with at least one response token of each sequence's token-mean KL, the quantity an
    adaptive controller tracks.
    """
    m = _as_bool(mask, token_scores)
    kld = kl_penalty(old_log_probs, ref_log_probs, kind)
    kld = torch.where(m, kld, torch.zeros((), dtype=kld.dtype, device=kld.device))
    token_rewards = token_scores - kl_coef * kld
    seq_kl = masked_mean(kld, m, dim=-1)
    mean_kl = masked_mean(seq_kl, m.any(-1))
    return token_rewards, mean_kl.detach()


class FixedKLController:
    """A constant KL coefficient (``algorithm.kl_ctrl.type=fixed``)."""

    def __init__(self, kl_coef: float):
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        """No-op; present so fixed and adaptive controllers are interchangeable."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def rescale(self, factor: float) -> None:
        """Multiply the coefficient (the KL guard's scale after a rollback)."""
        self.value *= factor

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """KL coefficient steered toward ``target_kl`` (Ziegler et al. 2019, ``algorithm.kl_ctrl.type=adaptive``).

    Each update: e = clip(current_kl / target_kl - 1, -0.2, 0.2); value *= 1 + e * n_steps / horizon.
    n_steps is the number of samples (or steps) the KL was measured over, so the speed of adaptation does not
    depend on the batch size.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if init_kl_coef < 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef}")
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"target_kl and horizon must be > 0, got target_kl={target_kl}, horizon={horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target_kl": self.target, "horizon": self.horizon}

    def rescale(self, factor: float) -> None:
        """Multiply the coefficient (the KL guard's scale after a rollback); the controller moves on from there."""
        self.value *= factor

    def load_state_dict(self, state: dict[str, float]) -> None:
        # Only the coefficient is state; target and horizon come from the (possibly edited) config of the run.
        self.value = float(state["value"])


def build_kl_controller(
    kind: str, *, kl_coef: float, target_kl: float | None = None, horizon: int | None = None
) -> FixedKLController | AdaptiveKLController:
    """Controller from ``algorithm.kl_ctrl.{type, kl_coef, target_kl, horizon}`` values (not the config object)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError("an adaptive KL controller needs kl_ctrl.target_kl and kl_ctrl.horizon")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller type {kind!r}; valid types: fixed, adaptive")


# ----------------------------------------------------------------------------------------------------------------
# losses


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    num_tokens: int | torch.Tensor | None = None,
    num_seqs: int | torch.Tensor | None = None,
    norm_length: int | float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a scalar (verl's ``loss_agg_mode``).

    - ``token-mean``: masked sum / num_tokens (default: this batch's token count).
    - ``token-sum``: masked sum.
    - ``seq-mean-token-sum``: sum over sequences of their token sums / num_seqs.
    - ``seq-mean-token-mean``: sum over sequences of their token means / num_seqs.
    - ``seq-mean-token-sum-norm``: as ``seq-mean-token-sum``, further divided by norm_length (default T) (Dr. GRPO).
    num_seqs defaults to the number of sequences with at least one token here. Passing the global counts of the
    mini-batch (across micro-batches and data-parallel ranks) makes the sum of the pieces' losses equal the
    mini-batch loss, so gradients can simply be accumulated and summed. Nothing counted gives 0, never NaN.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; valid modes: {', '.join(AGG_MODES)}")
    if loss_mat.dim() != 2:
        raise ValueError(f"loss_mat must be [B, T], got shape {tuple(loss_mat.shape)}")
    m = _as_bool(mask, loss_mat)

    def safe_div(total: torch.Tensor, count: int | torch.Tensor) -> torch.Tensor:
        count = torch.as_tensor(count, dtype=total.dtype, device=total.device)
        return torch.where(count > 0, total / count.clamp_min(1e-12), torch.zeros_like(total))

    if mode == "token-sum":
        return masked_sum(loss_mat, m)
    if mode == "token-mean":
        return safe_div(masked_sum(loss_mat, m), m.sum() if num_tokens is None else num_tokens)

    seq_tokens = m.sum(-1)
    seq_loss = masked_sum(loss_mat, m, dim=-1)
    if mode == "seq-mean-token-mean":
        seq_loss = seq_loss / seq_tokens.clamp_min(1).to(seq_loss.dtype)
    n_seqs = (seq_tokens > 0).sum() if num_seqs is None else num_seqs
    loss = safe_div(seq_loss.sum(), n_seqs)
    if mode == "seq-mean-token-sum-norm":
        loss = loss / float(loss_mat.shape[-1] if norm_length is None else norm_length)
    return loss


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float | None = 3.0,
    agg_mode: str = "token-mean",
    num_tokens: int | torch.Tensor | None = None,
    num_seqs: int | torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    norm_length: int | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped-surrogate PPO loss with asymmetric clip range and dual clip (Ye et al. 2020).

    log_probs, old_log_probs, advantages, mask: [B, T]. Returns (scalar loss, metrics).
    is_weights: [B, T] importance weights of the rollout correction (`rollout_correction.py`), detached, multiplying
    each token's (dual-)clipped loss before aggregation (verl 0.9.1); the metrics ignore them. norm_length: see
    ``aggregate_loss``. The other loss modes are in ``megappo.algos.policy_losses``.
    Per token: ratio r = exp(clamp(logp - old, -20, 20)); loss = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high));
    for A < 0 that is further capped at -A clip_c, so a huge ratio on a bad token cannot dominate the batch.
    Metrics (detached scalars): ``pg_clipfrac`` fraction of tokens where the clipped term is larger,
    ``pg_clipfrac_lower`` fraction where the dual clip is active, ``ppo_kl`` masked mean of old - new log-prob.
    """
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip ratios must be >= 0, got clip_low={clip_low}, clip_high={clip_high}")
    if clip_c is not None and clip_c <= 1.0:
        raise ValueError(f"clip_c (clip_ratio_c) must be > 1 for dual clip, got {clip_c}; pass None to disable it")
    m = _as_bool(mask, log_probs)
    # Zero the masked positions up front: padding may hold -inf/NaN log-probs, and although the reductions skip
    # them, 0 * NaN in the backward pass would still poison the gradient of the valid tokens' inputs.
    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    advantages = torch.where(m, advantages, zero)
    neg_approx_kl = torch.where(m, torch.clamp(log_probs - old_log_probs, min=-20.0, max=20.0), zero)
    ratio = torch.exp(neg_approx_kl)

    pg_unclipped = -advantages * ratio
    pg_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg_losses = torch.maximum(pg_unclipped, pg_clipped)
    clipfrac = masked_mean((pg_clipped > pg_unclipped).to(ratio.dtype), m)
    if clip_c is not None:
        pg_cap = -advantages * clip_c
        dual_active = (advantages < 0) & (pg_losses > pg_cap)
        # minimum, not a where on dual_active: at an exact tie (ratio == clip_c) it splits the gradient between
        # the cap and the clipped loss, as verl's torch.min does
        pg_losses = torch.where(advantages < 0, torch.minimum(pg_cap, pg_losses), pg_losses)
        clipfrac_lower = masked_mean(dual_active.to(ratio.dtype), m)
    else:
        clipfrac_lower = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
    if is_weights is not None:
        pg_losses = pg_losses * torch.where(m, is_weights.detach().to(pg_losses.dtype), zero)

    loss = aggregate_loss(pg_losses, m, agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length)
    metrics = {
        "pg_clipfrac": clipfrac.detach(),
        "pg_clipfrac_lower": clipfrac_lower.detach(),
        "ppo_kl": masked_mean(-neg_approx_kl, m).detach(),
    }
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_range: float | None = 0.5,
    agg_mode: str = "token-mean",
    num_tokens: int | torch.Tensor | None = None,
    num_seqs: int | torch.Tensor | None = None,
    norm_length: int | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: 0.5 * aggregate(max((v - R)^2, (clip(v, old - c, old + c) - R)^2)).

    values, old_values, returns, mask: [B, T]. Returns (scalar loss, {"vf_clipfrac"}); clip_range=None disables
    the clipped term (plain 0.5 * MSE).
    """
    if clip_range is not None and clip_range < 0:
        raise ValueError(f"clip_range (critic.cliprange_value) must be >= 0 or None, got {clip_range}")
    m = _as_bool(mask, values)
    returns = torch.where(m, returns, values.detach())  # masked garbage must not reach the gradient (see above)
    old_values = torch.where(m, old_values, values.detach())
    vf_unclipped = (values - returns).square()
    if clip_range is None:
        vf_losses = vf_unclipped
        clipfrac = torch.zeros((), dtype=values.dtype, device=values.device)
    else:
        # clamp v itself (not old + clamp(v - old)): inside the range v_clipped is v bit for bit, so vf_clipfrac
        # counts only tokens the clip changed
        v_clipped = torch.clamp(values, old_values - clip_range, old_values + clip_range)
        vf_clipped = (v_clipped - returns).square()
        vf_losses = torch.maximum(vf_unclipped, vf_clipped)
        clipfrac = masked_mean((vf_clipped > vf_unclipped).to(values.dtype), m)
    loss = 0.5 * aggregate_loss(vf_losses, m, agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                                norm_length=norm_length)
    return loss, {"vf_clipfrac": clipfrac.detach()}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution softmax(logits). logits: [..., V]. Returns [...].

    H = logsumexp(z) - sum(softmax(z) * z), which needs one softmax instead of a softmax and a log_softmax.
    Half-precision logits are upcast to float32 (bf16 sums over a 150k vocabulary lose too many bits); entries of
    -inf (masked vocabulary) contribute 0.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    p_z = torch.where(probs > 0, probs * logits, torch.zeros((), dtype=logits.dtype, device=logits.device))
    return torch.logsumexp(logits, dim=-1) - p_z.sum(-1)
