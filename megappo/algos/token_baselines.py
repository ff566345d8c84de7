"""Optimal token baselines (verl 0.9.1's ``optimal_token_baseline`` and ``tir_optimal_token_baseline``).

A per-token baseline for each prompt group instead of GRPO's one number per response: at step t,
B_t = sum_i G_i,t W_i,t / (sum_i W_i,t + eps) over the group's responses i, where G is the return-to-go and
W_t = sum_{j <= t} w_j the cumulative path variance of the response so far, w_j = 1 - 2 pi_j + sum_v pi_v^2 (pi_j the
old policy's probability of the sampled token, sum_v pi_v^2 over the vocabulary); with rollout IS weights rho,
w_j is scaled by rho_j^2. A = (G - B) on the response tokens.

``optimal_token_baseline`` aligns the responses of a group by their position in the [B, T] layout;
``tir_optimal_token_baseline`` (tool-integrated, multi-turn) by the index among each response's own model tokens,
so tool-answer holes in the mask do not shift one response against another, and leaves empty responses out of
their group. handle_zero_tail: the part of a group's single longest response beyond the second longest gets no
baseline (nothing to compare it with). A response alone in its group gets none either.

The trainer's old log-prob forward returns sum_v pi_v^2 for these estimators (verl's
``actor.calculate_sum_pi_squared``; ``megappo.models.vocab_parallel``), and its advantage phase gathers the [B, T]
inputs of every data-parallel rank first, since a prompt's group may be split over them.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["optimal_token_baseline", "tir_optimal_token_baseline"]


def _per_group(values: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
    """[N, L] -> [k, L]: the sum over each group's rows."""
    return torch.zeros((k, values.shape[1]), dtype=values.dtype, device=values.device).index_add_(0, inverse, values)


def _compact(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Each row's masked entries moved to the front, in order; zeros after. x, m: [N, T] -> [N, max valid]."""
    lengths = m.sum(-1)
    out = x.new_zeros((x.shape[0], int(lengths.max()) if x.numel() else 0))
    rows, cols = torch.nonzero(m, as_tuple=True)
    out[rows, (m.cumsum(-1) - 1)[rows, cols]] = x[rows, cols]
    return out


@torch.no_grad()
def optimal_token_baseline(
    token_rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor, old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor, *, is_weights: Optional[torch.Tensor] = None, by_model_token: bool = False,
    handle_zero_tail: bool = True, eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages with a per-token optimal baseline (see the module). All [B, T] but group_ids [B].

    by_model_token: align a group's responses by their model tokens (tir_optimal_token_baseline) instead of by
    column. Returns (advantages [B, T], zero off the mask; returns-to-go [B, T])."""
    m = mask.bool()
    mf = mask.to(token_rewards.dtype)
    returns = (token_rewards * mf).flip(-1).cumsum(-1).flip(-1)
    w = 1 - 2 * torch.exp(old_log_probs) + sum_pi_squared
    if is_weights is not None:
        w = w * is_weights.square()
    cum_w = (w * mf).cumsum(-1)
    lengths = m.sum(-1)
    if by_model_token:
        G, W, M = _compact(returns, m), _compact(cum_w, m), _compact(torch.ones_like(mf), m)
        member = lengths > 0  # empty responses are in no group
    else:
        G, W, M = returns, cum_w, mf
        member = torch.ones_like(lengths, dtype=torch.bool)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    inverse = torch.where(member, inverse, torch.full_like(inverse, -1)) + 1  # group 0: the non-members
    k = int(inverse.max()) + 1 if inverse.numel() else 1
    size = torch.zeros(k, dtype=torch.long, device=m.device).index_add_(0, inverse, torch.ones_like(inverse))
    num, den = _per_group(G * W * M, inverse, k), _per_group(W * M, inverse, k)
    baseline = (num / (den + eps))[inverse]
    baseline = torch.where(((size[inverse] > 1) & (inverse > 0)).unsqueeze(-1), baseline, torch.zeros_like(baseline))
    if handle_zero_tail:
        for g in range(1, k):
            rows = torch.nonzero(inverse == g).squeeze(1)
            if rows.numel() < 2:
                continue
            top = torch.sort(lengths[rows]).values
            longest = rows[lengths[rows] == top[-1]]
            if longest.numel() == 1 and top[-1] > top[-2]:
                baseline[longest[0], int(top[-2]):] = 0.0
    adv = G - baseline
    if by_model_token:
        out = torch.zeros_like(returns)
        rows, cols = torch.nonzero(m, as_tuple=True)
        out[rows, cols] = adv[rows, (m.cumsum(-1) - 1)[rows, cols]]
        adv = out
    return adv * mf, returns


def tir_optimal_token_baseline(token_rewards, mask, group_ids, old_log_probs, sum_pi_squared, *, is_weights=None,
                               handle_zero_tail: bool = True, eps: float = 1e-8):
    """`optimal_token_baseline` with a group's responses aligned by their model tokens (multi-turn rollouts)."""
    return optimal_token_baseline(token_rewards, mask, group_ids, old_log_probs, sum_pi_squared,
                                  is_weights=is_weights, by_model_token=True, handle_zero_tail=handle_zero_tail,
                                  eps=eps)
