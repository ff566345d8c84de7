"""Reductions of a step's per-rank numbers over the data-parallel ranks (each a no-op on one rank)."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megappo.parallel import ParallelState, gather_over_ranks, reduce_over_ranks, reduce_tensor


def dp_gather(t: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """Concatenate a [B] tensor over the data-parallel ranks (every rank has the same B; per-token [B, R] tensors
    differ in R between ranks: reduce their sums instead)."""
    return gather_over_ranks(t, ps.dp_group) if ps.dp_size > 1 else t


def dp_gather_rows(t: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """`dp_gather` of a [B] tensor, or of each row of a [K, B] one."""
    return dp_gather(t, ps) if t.dim() == 1 else torch.stack([dp_gather(row, ps) for row in t])


def dp_sum(values: list[float], ps: ParallelState) -> list[float]:
    return reduce_over_ranks(values, group=ps.dp_group) if ps.dp_size > 1 else list(values)


def dp_sum_tensor(ps: ParallelState):
    """A function summing a tensor over the data-parallel ranks (`algos.masked_whiten`'s `sum_across`)."""
    def sum_across(t: torch.Tensor) -> torch.Tensor:
        return reduce_tensor(t, group=ps.dp_group) if ps.dp_size > 1 else t
    return sum_across


def dp_max(value: float, ps: ParallelState) -> float:
    return reduce_over_ranks([value], dist.ReduceOp.MAX, ps.dp_group)[0] if ps.dp_size > 1 else float(value)


def masked_mean_dp(x: torch.Tensor, mask: torch.Tensor, ps: ParallelState) -> float:
    total, count = dp_sum([float((x * mask).sum()), float(mask.sum())], ps)
    return total / max(count, 1.0)


def dp_metrics(local: dict[str, float], ps: ParallelState) -> dict[str, float]:
    """Each rank's metrics of its share made one number per step: the largest `*_max`, the smallest `*_min`, the
    mean of the others over the ranks that have them (a rank without a valid token reports none)."""
    if ps.dp_size == 1:
        return local
    everyone = gather_objects_dp(local, ps)
    keys = sorted({k for m in everyone for k in m})
    out = {}
    for k in keys:
        values = [m[k] for m in everyone if k in m]
        out[k] = max(values) if k.endswith("_max") else min(values) if k.endswith("_min") else sum(values) / len(values)
    return out


def gather_objects_dp(obj: Any, ps: ParallelState) -> list:
    out: list = [None] * ps.dp_size
    dist.all_gather_object(out, obj, group=ps.dp_group)
    return out


def explained_variance_dp(returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, ps: ParallelState) -> float:
    """1 - Var(returns - values) / Var(returns) over the step's response tokens, from moments summed over the
    data-parallel ranks (their [B, R] tensors differ in R, so they cannot be gathered)."""
    m, res = mask.to(torch.float64), (returns - values).double()
    ret = returns.double()
    n, s1, s2, r1, r2 = dp_sum([float(m.sum()), float((ret * m).sum()), float((ret * ret * m).sum()),
                                float((res * m).sum()), float((res * res * m).sum())], ps)
    n = max(n, 1.0)
    var_ret, var_res = s2 / n - (s1 / n) ** 2, r2 / n - (r1 / n) ** 2
    return 1.0 - var_res / (var_ret + 1e-8)


def trains_on_nothing(mask: torch.Tensor, ps: ParallelState) -> bool:
    """Whether no rank has a token to train on this step (`mask` [B, R], this rank's loss mask: every episode failed
    and was dropped, or a judge skipped every group). Its updates are skipped: an optimizer step on zero gradients
    still moves the weights (AdamW's weight decay, Adam's moments of earlier steps)."""
    return dp_sum([float(mask.sum())], ps)[0] == 0
