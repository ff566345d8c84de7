"""Off-policy rollout correction: verl 0.9.1's ``algorithm.rollout_correction`` (``rollout_corr_helper``), as math.

The rollout engine samples from pi_rollout (its own kernels, precision, maybe an older checkpoint); the trainer's
pi_old (recomputed old log-probs) differs. With log_ratio = old - rollout per token:

- IS weights (``rollout_is``): ``token`` w_t = exp(clamp(log_ratio_t, +-20)); ``sequence`` one weight per row,
  exp(clamp(sum_t log_ratio_t, +-20)), on every token. ``rollout_is_threshold`` a number or "U": truncated IS
  (TIS), w = min(w, U); a string "L_U": IcePop, w = 0 outside [L, U]. Zero on padding; detached. With
  ``rollout_is_batch_normalize`` divided by their mean (token mean, or mean over non-empty rows of each row's token
  mean for ``sequence``) when that mean is > 1e-8. verl's PPO loss multiplies its per-token (dual-)clipped loss
  by w before aggregation; the clip fractions and ppo_kl ignore w. "Geo-RS" in verl's presets is seq_mean_k1.
- Rejection (``rollout_rs``, comma-separated options, all must pass): per-token statistics k1 = -log_ratio,
  k2 = log_ratio^2 / 2, k3 = exp(log_ratio) - 1 - log_ratio (log_ratio clamped to +-20), used per token
  (``token_kN``) or reduced per row by masked sum / mean / max (``seq_sum_kN``, ``seq_mean_kN``, ``seq_max_kN``;
  no seq_max_k1) and broadcast. k1 keeps log(L) <= stat <= log(U) (threshold "L_U", or "U" meaning L = 1/U); k2/k3
  keep stat <= U. ``rollout_rs_threshold`` is one value for all options or one per option, comma-separated.
  Rejected tokens leave the returned mask; IS weights are computed from the original mask and not re-zeroed.
- Metrics (every step, even with both off): ``rollout_corr/`` + verl's names: kl, k3_kl, training_ppl,
  rollout_ppl, ppl_ratio, log_ppl_*, chi2_token, chi2_seq; rollout_is_* (mean, max, min, std, eff_sample_size,
  ratio_fraction_high/low, seq_*, oob_ratio, batch_norm_factor); rollout_rs_* (masked_fraction,
  seq_masked_fraction and per option ``rollout_rs_<option>_{mean,max,min,std,fraction_high,...}``).

``bypass_mode`` (old log-probs := rollout log-probs, no recompute) moves all of this into the loss, per
micro-batch, with the current policy's detached log-probs in the role of old: see ``bypass_policy_loss``.

Differences from verl 0.9.1, on purpose: a batch with no valid token gives zero weights, the mask unchanged and no
metrics (verl raises); masked positions never leak NaN/inf into weights (verl multiplies by the mask); exponents
verl leaves unclamped in metrics (k3_kl, *_ppl, ppl_ratio, sequence rollout_is_min) are capped at 50 so they stay
finite; an all-zero IcePop batch reports eff_sample_size 0 (verl divides by zero); half precision is upcast to
float32; an enabled ``rollout_is`` with a null threshold is a config error (verl silently skips IS). Shapes: [B, R].
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megappo.algos import aggregate_loss, masked_mean, policy_loss

__all__ = ["IS_LEVELS", "LOSS_TYPES", "RS_OPTIONS", "RolloutCorrection", "bypass_policy_loss",
           "compute_rollout_corr_metrics", "compute_rollout_correction", "reinforce_policy_loss"]

SAFETY_BOUND = 20.0  # verl's clamp of log-ratios before exp (weights, rejection statistics, chi2)
METRIC_EXP_BOUND = 50.0  # megappo's cap where verl exponentiates unclamped (metrics only)
IS_LEVELS = ("token", "sequence")
LOSS_TYPES = ("ppo_clip", "reinforce")
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
_KEY = "algorithm.rollout_correction."


def _bad(key: str, msg: str) -> ValueError:
    return ValueError(f"{_KEY}{key}: {msg}")


def _number(text: str, key: str, spec: Any) -> float:
    try:
        return float(text)
    except ValueError:
        raise _bad(key, f"invalid threshold {spec!r}: {text!r} is not a number") from None


def _parse_is_threshold(spec: Any) -> tuple[float, float | None]:
    """``rollout_is_threshold`` -> (upper, lower or None). A number / "U": TIS; "L_U": IcePop."""
    key = "rollout_is_threshold"
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise _bad(key, f"must be a positive number (TIS) or a 'lower_upper' string (IcePop), got {spec!r}")
    text = spec.strip() if isinstance(spec, str) else str(float(spec))
    lo, up = text.split("_", 1) if "_" in text else (None, text)
    upper, lower = _number(up, key, spec), None if lo is None else _number(lo, key, spec)
    if not upper > 0 or (lower is not None and not lower > 0):
        raise _bad(key, f"bounds must be positive, got {spec!r}")
    if lower is not None and lower > upper:
        raise _bad(key, f"lower bound must be <= upper bound, got {spec!r}")
    return upper, lower


def _parse_rs(rollout_rs: Any, spec: Any) -> tuple[tuple[str, float | None, float], ...]:
    """(``rollout_rs``, ``rollout_rs_threshold``) -> ((option, lower or None, upper), ...), duplicates dropped."""
    options = list(dict.fromkeys(o.strip() for o in rollout_rs.split(",") if o.strip())) \
        if isinstance(rollout_rs, str) else [None]
    for opt in options or [None]:
        if opt not in RS_OPTIONS:
            raise _bad("rollout_rs", f"invalid option {opt!r} in {rollout_rs!r}; give null or comma-separated "
                                     f"options from: {', '.join(RS_OPTIONS)}")
    key = "rollout_rs_threshold"
    if spec is None:
        raise _bad(key, f"must be set when rollout_rs is set (rollout_rs={rollout_rs!r})")
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise _bad(key, f"must be a number or a comma-separated string, got {spec!r}")
    specs = [str(spec)] if not isinstance(spec, str) else [p.strip() for p in spec.split(",") if p.strip()]
    if len(specs) not in (1, len(options)):
        raise _bad(key, f"give one threshold for all options or exactly {len(options)}, got {spec!r}")
    out = []
    for opt, s in zip(options, specs * len(options) if len(specs) == 1 else specs, strict=True):
        k1 = opt.endswith("k1")  # k1: ratio bounds "L_U", or "U" meaning L = 1 / U; k2/k3: an upper bound
        if "_" in s and not k1:
            raise _bad(key, f"{opt} takes a single upper bound, not 'lower_upper' ({s!r})")
        lo, up = s.split("_", 1) if "_" in s else (None, s)
        upper = _number(up, key, spec)
        lower = None if not k1 else (_number(lo, key, spec) if lo is not None else 1.0 / upper if upper else 0.0)
        if not upper > 0 or (k1 and not 0 < lower <= upper):
            raise _bad(key, f"{opt} needs positive bounds{' with lower <= upper' if k1 else ''}, got {s!r}")
        out.append((opt, lower, upper))
    return tuple(out)


@dataclass(frozen=True)
class RolloutCorrection:
    """``algorithm.rollout_correction.*`` with verl's names; the values (and their defaults) come from the config
    section (``megappo.trainer.settings.rollout_correction``), and ``check`` is preflight's test of them.

    bypass_mode: False (decoupled): old log-probs are recomputed, correction runs once per batch on old vs rollout.
    True: old log-probs := rollout log-probs; the correction runs inside the loss (``bypass_policy_loss``).
    loss_type (bypass only): ``ppo_clip`` the clipped surrogate with ratio pi / pi_rollout, IS weights not
    applied (computed for metrics), rejection mask applied; ``reinforce`` -A * log pi * w (``reinforce_policy_loss``).
    """

    rollout_is: str | None
    rollout_is_threshold: str | float | None
    rollout_is_batch_normalize: bool
    rollout_rs: str | None
    rollout_rs_threshold: str | float | None
    bypass_mode: bool
    loss_type: str
    preset: str | None  # the verl preset the fields started from (``megappo.config.rollout_presets``)

    def check(self) -> None:
        """Raise ValueError naming the key of the first value the math cannot take."""
        if self.rollout_is not in (None, *IS_LEVELS):
            raise _bad("rollout_is", f"got {self.rollout_is!r}; valid values: null, token, sequence")
        if self.rollout_is is not None and self.rollout_is_threshold is None:
            raise _bad("rollout_is_threshold", f"must be set when rollout_is={self.rollout_is!r}")
        if self.rollout_is_threshold is not None:
            _parse_is_threshold(self.rollout_is_threshold)
        if self.rollout_rs is not None:
            _parse_rs(self.rollout_rs, self.rollout_rs_threshold)
        for key in ("rollout_is_batch_normalize", "bypass_mode"):
            if not isinstance(getattr(self, key), bool):
                raise _bad(key, f"must be true or false, got {getattr(self, key)!r}")
        if self.loss_type not in LOSS_TYPES:
            raise _bad("loss_type", f"got {self.loss_type!r}; valid values: {', '.join(LOSS_TYPES)}")

    @property
    def is_bounds(self) -> tuple[float, float | None]:
        """(upper, IcePop lower or None) of ``rollout_is_threshold``."""
        return _parse_is_threshold(self.rollout_is_threshold)

    @property
    def rs_specs(self) -> tuple[tuple[str, float | None, float], ...]:
        """((option, lower or None, upper), ...) of the rejection options; () when off."""
        return () if self.rollout_rs is None else _parse_rs(self.rollout_rs, self.rollout_rs_threshold)


# Helpers; m is the response mask as bool. Means follow verl's masked_mean: sum / (count + 1e-8).


def _msum(x: torch.Tensor, m: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    xm = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return xm.sum() if dim is None else xm.sum(dim)


def _mmean(x: torch.Tensor, m: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    return _msum(x, m, dim) / ((m.sum() if dim is None else m.sum(dim)) + 1e-8)


def _mmax_min(x: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.masked_fill(~m, float("-inf")).max(), x.masked_fill(~m, float("inf")).min()


def _clamped_std(x: torch.Tensor, m: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """verl's std of x clamped to [lo, hi] over the mask (population variance), 0 for fewer than 2 tokens."""
    xc = x.clamp(min=lo, max=hi)
    var = _mmean(xc.square(), m) - _mmean(xc, m).square()
    return torch.where(m.sum() > 1, torch.sqrt(torch.clamp(var, min=0.0)), torch.zeros_like(var))


def _seq_stats(prefix: str, v: torch.Tensor, upper: float, lower: float | None) -> dict[str, Any]:
    """Summary of per-row values v [N] (N >= 1): mean, std (unbiased), max, min, fractions above/below."""
    out: dict[str, Any] = {f"{prefix}seq_mean": v.mean(), f"{prefix}seq_std": v.std() if v.numel() > 1 else 0.0,
                           f"{prefix}seq_max": v.max(), f"{prefix}seq_min": v.min(),
                           f"{prefix}seq_fraction_high": (v > upper).float().mean()}
    if lower is not None:
        out[f"{prefix}seq_fraction_low"] = (v < lower).float().mean()
    return out


def _floats(metrics: dict[str, Any]) -> dict[str, float]:
    """Tensors to Python floats with one device sync; every key gets the ``rollout_corr/`` prefix."""
    keys = [k for k, v in metrics.items() if isinstance(v, torch.Tensor)]
    values = torch.stack([metrics[k].detach().double().reshape(()) for k in keys]).tolist() if keys else []
    out = {f"rollout_corr/{k}": float(v) for k, v in metrics.items() if not isinstance(v, torch.Tensor)}
    out.update({f"rollout_corr/{k}": v for k, v in zip(keys, values, strict=True)})
    return out


def _prepare(old: torch.Tensor, rollout: torch.Tensor | None, mask: torch.Tensor):
    if old.dim() != 2 or mask.shape != old.shape or (rollout is not None and rollout.shape != old.shape):
        raise ValueError(f"old_log_probs {tuple(old.shape)}, rollout_log_probs {tuple(getattr(rollout, 'shape', ()))}"
                         f" and response_mask {tuple(mask.shape)} must all be the same [B, R]")
    def up(t: torch.Tensor) -> torch.Tensor:
        return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t

    return up(old), None if rollout is None else up(rollout), mask.bool()


def _offpolicy_metrics(old: torch.Tensor, rollout: torch.Tensor | None, m: torch.Tensor) -> dict[str, Any]:
    mean_old = _mmean(old, m, -1)  # [B], 0 for empty rows (which still count in the batch means, as in verl)
    out: dict[str, Any] = {"training_ppl": torch.exp((-mean_old).clamp(max=METRIC_EXP_BOUND)).mean(),
                           "training_log_ppl": (-mean_old).mean()}
    if rollout is None:
        return out
    lr = old - rollout
    mean_roll = _mmean(rollout, m, -1)
    log_ppl_diff = mean_roll - mean_old  # log(training ppl / rollout ppl) per row
    lr_safe = lr.clamp(min=-SAFETY_BOUND, max=SAFETY_BOUND)
    lr_seq = _msum(lr, m, -1).clamp(min=-SAFETY_BOUND, max=SAFETY_BOUND)
    out.update({
        "kl": _mmean(rollout - old, m),  # k1 estimate of KL(rollout || old)
        "k3_kl": _mmean(torch.exp(lr.clamp(max=METRIC_EXP_BOUND)) - lr - 1, m),
        "rollout_ppl": torch.exp((-mean_roll).clamp(max=METRIC_EXP_BOUND)).mean(),
        "rollout_log_ppl": (-mean_roll).mean(),
        "log_ppl_diff": log_ppl_diff.mean(), "log_ppl_abs_diff": log_ppl_diff.abs().mean(),
        "log_ppl_diff_max": log_ppl_diff.max(), "log_ppl_diff_min": log_ppl_diff.min(),
        "ppl_ratio": torch.exp(log_ppl_diff.clamp(max=METRIC_EXP_BOUND)).mean(),
        "chi2_token": _mmean(torch.exp(lr_safe).square(), m) - 1.0,
        "chi2_seq": torch.exp(2.0 * lr_seq).mean() - 1.0,
    })
    return out


def _is_weights(lr: torch.Tensor, m: torch.Tensor, s: RolloutCorrection, with_metrics: bool,
                sum_across: Callable[[torch.Tensor], torch.Tensor] | None) -> tuple[torch.Tensor, dict]:
    upper, lower = s.is_bounds
    zero = torch.zeros((), dtype=lr.dtype, device=lr.device)
    lr_stat = lr if s.rollout_is == "token" else _msum(lr, m, -1).unsqueeze(-1)  # [B, 1]: log sequence ratio
    raw = torch.where(m, torch.exp(lr_stat.clamp(min=-SAFETY_BOUND, max=SAFETY_BOUND)).expand_as(lr), zero)
    w = raw.clamp(max=upper) if lower is None else torch.where((raw >= lower) & (raw <= upper), raw, zero)

    met: dict[str, Any] = {}
    if with_metrics:
        low = 1.0 / upper if lower is None else lower
        if s.rollout_is == "sequence":
            log_up, log_low = (torch.log(torch.tensor(t, dtype=torch.float32, device=lr.device)) for t in (upper, low))
            met["rollout_is_max"] = torch.exp(torch.clamp(lr_stat.max(), max=SAFETY_BOUND))
            met["rollout_is_min"] = torch.exp(torch.clamp(lr_stat.min(), max=METRIC_EXP_BOUND))
            met["rollout_is_mean"] = _mmean(w, m)
            met["rollout_is_ratio_fraction_high"] = (lr_stat > log_up).float().mean()
            met["rollout_is_ratio_fraction_low"] = (lr_stat < log_low).float().mean()
        else:
            met["rollout_is_mean"] = _mmean(w, m)
            met["rollout_is_ratio_fraction_high"] = _mmean((raw > upper).float(), m)
            met["rollout_is_ratio_fraction_low"] = _mmean((raw < low).float(), m)
            met["rollout_is_max"], met["rollout_is_min"] = _mmax_min(w, m)
        met["rollout_is_std"] = _clamped_std(w, m, 0.0, upper)
        w_ess = w.clamp(min=0.0, max=upper)
        second = _mmean((w_ess / (_mmean(w_ess, m) + 1e-8)).square(), m)
        met["rollout_is_eff_sample_size"] = torch.where(second > 0, 1.0 / second, torch.zeros_like(second))
        seq_w = _mmean(w, m, -1)  # per row, over all rows (empty rows give 0, as in verl)
        met.update(_seq_stats("rollout_is_", seq_w, upper, None))
        met["rollout_is_seq_max_deviation"] = (seq_w - 1.0).abs().max()
        raw_seq = _mmean(raw, m, -1)  # fractions from the untruncated row means
        met["rollout_is_seq_fraction_high"] = (raw_seq > upper).float().mean()
        met["rollout_is_seq_fraction_low"] = (raw_seq < low).float().mean()
        if lower is not None:
            met["rollout_is_oob_ratio"] = _mmean(((raw < lower) | (raw > upper)).float(), m)

    if s.rollout_is_batch_normalize:
        if s.rollout_is == "token":
            num, den = _msum(w, m), m.sum().to(w.dtype)
        else:
            seq_w, seq_m = _mmean(w, m, -1), m.any(-1).to(w.dtype)
            num, den = (seq_w * seq_m).sum(), seq_m.sum()
        if sum_across is not None:  # verl's distributed_masked_mean: global sum / global count, no eps
            num, den = sum_across(torch.stack([num, den])).unbind()
            mean = num / den
        else:
            mean = _mmean(w, m) if s.rollout_is == "token" else num / den.clamp_min(1e-8)
        ok = mean > 1e-8
        w = torch.where(ok, w / torch.where(ok, mean, torch.ones_like(mean)), w)
        met["rollout_is_batch_norm_factor"] = torch.where(ok, mean, torch.ones_like(mean))
    return w, met


def _rejection(lr: torch.Tensor, m: torch.Tensor, s: RolloutCorrection) -> tuple[torch.Tensor, dict]:
    """Keep mask [B, R] (float, 1 = keep) over all options, and the rejection metrics."""
    lr = lr.clamp(min=-SAFETY_BOUND, max=SAFETY_BOUND)
    token = {"k1": -lr, "k2": 0.5 * lr**2, "k3": torch.exp(lr) - 1.0 - lr}
    seq_valid, combined, met = m.any(-1), torch.ones_like(lr), {}
    for opt, lower, upper in s.rs_specs:
        level, kind = opt.rsplit("_", 1)
        k1, tok = kind == "k1", token[kind]
        hi, lo = (math.log(upper), math.log(lower)) if k1 else (upper, 0.0)
        if level == "token":
            stat, seq_stat = tok, _mmean(tok, m, -1)
        else:
            if level == "seq_max":  # a row without tokens gets 0
                mx = tok.masked_fill(~m, float("-inf")).max(dim=-1).values
                seq_stat = torch.where(mx == float("-inf"), torch.zeros_like(mx), mx)
            else:
                seq_stat = (_msum if level == "seq_sum" else _mmean)(tok, m, -1)
            stat = seq_stat.unsqueeze(-1).expand_as(lr)
        keep = (stat >= lo) & (stat <= hi) if k1 else stat <= hi
        keep_f = keep.to(lr.dtype)
        combined = combined * keep_f
        p, seq_v = f"rollout_rs_{opt}_", seq_stat[seq_valid]
        met[p + "mean"] = _mmean(stat, m)
        if level == "token":
            met[p + "max"], met[p + "min"] = _mmax_min(stat, m)
            met[p + "fraction_high"] = _mmean((stat > hi).float(), m)
            met[p + "fraction_low"] = _mmean((stat < lo).float(), m) if k1 else 0.0
        else:
            met[p + "max"], met[p + "min"] = seq_v.max(), seq_v.min()
            met[p + "fraction_high"] = (seq_v > hi).float().mean()
            met[p + "fraction_low"] = (seq_v < lo).float().mean() if k1 else 0.0
        met[p + "std"] = _clamped_std(stat, m, lo, hi)
        met.update(_seq_stats(p, seq_v, hi, lo if k1 else None))
        met[p + "seq_max_deviation"] = seq_v.abs().max()
        met[p + "masked_fraction"] = _mmean(1 - keep_f, m)
        seq_keep, valid_f = (keep | ~m).all(-1).to(lr.dtype), seq_valid.float()
        met[p + "seq_masked_fraction"] = ((1.0 - seq_keep) * valid_f).sum() / valid_f.sum()

    met["rollout_rs_masked_fraction"] = _mmean(1 - combined, m)
    met["rollout_rs_seq_masked_fraction"] = ((combined <= 0.5) & m).any(-1).float().mean()
    return combined, met


@torch.no_grad()
def compute_rollout_correction(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
    settings: RolloutCorrection, *, sum_across: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """IS weights, rejection mask and metrics (verl's ``compute_rollout_correction_and_rejection_mask``).

    old_log_probs, rollout_log_probs, response_mask: [B, R]; the mask any dtype (1 = response token).
    Returns (is_weights [B, R] detached, 0 on padding, or None when ``rollout_is`` is null;
    mask [B, R] in response_mask's dtype with rejected tokens set to 0 (a copy when ``rollout_rs`` is null);
    metrics {``rollout_corr/...``: float}, the local batch's, empty when no token is valid).
    sum_across: sums a 1-D tensor over every shard of the batch (e.g. an all-reduce over data-parallel ranks) for
    ``rollout_is_batch_normalize``; every shard must call this function when it is set, even an empty one.
    """
    old, rollout, m = _prepare(old_log_probs, rollout_log_probs, response_mask)
    has_tokens, lr = bool(m.any()), old - rollout
    metrics: dict[str, Any] = {}
    weights, new_mask = None, response_mask.clone()
    if settings.rollout_is is not None:
        weights, is_met = _is_weights(lr, m, settings, has_tokens, sum_across)
        metrics.update(is_met)
    if settings.rollout_rs is not None and has_tokens:
        keep, rs_met = _rejection(lr, m, settings)
        new_mask = (response_mask * keep).to(response_mask.dtype)
        metrics.update(rs_met)
    if not has_tokens:
        return weights, new_mask, {}
    metrics.update(_offpolicy_metrics(old, rollout, m))
    return weights, new_mask, _floats(metrics)


@torch.no_grad()
def compute_rollout_corr_metrics(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor | None, response_mask: torch.Tensor
) -> dict[str, float]:
    """The off-policy diagnostics alone (what a run with correction off logs each step).

    All [B, R]. rollout_log_probs None gives only training_ppl and training_log_ppl. Returns
    {``rollout_corr/kl``, ``k3_kl``, ``training_ppl``, ``rollout_ppl``, ``ppl_ratio``, ``log_ppl_*``, ``chi2_*``};
    empty when no token is valid.
    """
    old, rollout, m = _prepare(old_log_probs, rollout_log_probs, response_mask)
    return _floats(_offpolicy_metrics(old, rollout, m)) if bool(m.any()) else {}


def reinforce_policy_loss(
    log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
    is_weights: torch.Tensor | None = None, agg_mode: str = "token-mean",
    num_tokens: int | torch.Tensor | None = None, num_seqs: int | torch.Tensor | None = None,
    norm_length: int | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """REINFORCE with optional IS weights (verl's ``compute_policy_loss_reinforce``, bypass ``loss_type=reinforce``).

    All [B, T]. Per token loss = -A * log pi * w (w detached; 1 when is_weights is None), so the gradient is
    -A w grad log pi; no clipping. Aggregated like ``policy_loss`` (norm_length: see ``aggregate_loss``).
    Metrics: ``ppo_kl`` = masked mean of rollout - current log-prob (detached).
    """
    m = mask.bool() if mask.dtype != torch.bool else mask
    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    pg = -torch.where(m, advantages, zero) * torch.where(m, log_probs, zero)
    if is_weights is not None:
        pg = pg * torch.where(m, is_weights.detach(), zero)
    loss = aggregate_loss(pg, m, agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length)
    kl = masked_mean(torch.where(m, rollout_log_probs - log_probs.detach(), zero), m)
    return loss, {"ppo_kl": kl.detach()}


def bypass_policy_loss(
    log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    settings: RolloutCorrection, *, clip_low: float = 0.2, clip_high: float = 0.2, clip_c: float | None = 3.0,
    agg_mode: str = "token-mean", num_tokens: int | torch.Tensor | None = None,
    num_seqs: int | torch.Tensor | None = None, sum_across: Callable[[torch.Tensor], torch.Tensor] | None = None,
    norm_length: int | float | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's ``bypass_mode`` policy loss for one micro-batch; old log-probs are the rollout's.

    All [B, T]. The correction is computed as in ``compute_rollout_correction`` with the current policy's detached
    log_probs in the role of old (weights w = pi / pi_rollout); the loss is then taken over the rejection-masked
    tokens: ``loss_type=ppo_clip`` -> ``policy_loss(log_probs, rollout_log_probs, ...)`` with no IS weights (the
    ratio already is pi / pi_rollout); ``reinforce`` -> ``reinforce_policy_loss`` with w. num_tokens / num_seqs
    as for ``policy_loss`` (verl counts them before rejection); norm_length is seq-mean-token-sum-norm's constant
    divisor (``actor.loss_scale_factor``; None: this micro-batch's T, which differs between splits).
    Returns (loss, the loss's metrics as detached tensors merged with the ``rollout_corr/`` floats).
    """
    weights, eff_mask, corr = compute_rollout_correction(
        log_probs.detach(), rollout_log_probs, mask, settings, sum_across=sum_across)
    if settings.loss_type == "reinforce":
        loss, metrics = reinforce_policy_loss(log_probs, rollout_log_probs, advantages, eff_mask, is_weights=weights,
                                              agg_mode=agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                                              norm_length=norm_length)
    else:
        loss, metrics = policy_loss(log_probs, rollout_log_probs, advantages, eff_mask, clip_low=clip_low,
                                    clip_high=clip_high, clip_c=clip_c, agg_mode=agg_mode, num_tokens=num_tokens,
                                    num_seqs=num_seqs, norm_length=norm_length)
    return loss, {**metrics, **corr}
