"""Sequence-level losses (GSPO, GMPO, SAPO) and the seq-mean aggregations split like token-level ones: with the
mini-batch's global counts, the sum of the micro-batches' (or data-parallel ranks') losses and gradients is the
whole batch's, at any split (the trainer's `train_step` relies on it; see megappo/models/compute.py)."""
from __future__ import annotations

import pytest
import torch

from megappo import algos
from megappo.algos import policy_losses as pl

torch.set_num_threads(1)
B, T = 8, 9


def _inputs():
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = torch.arange(T)[None, :] < lengths[:, None]
    old = -2.0 * torch.rand(B, T, generator=g)
    new = old + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, 1, generator=g).expand(B, T) * mask
    return new, old, adv, mask, torch.exp(0.1 * torch.randn(B, T, generator=g))


def _loss_and_grad(mode, agg, rows_per_piece, weights):
    new, old, adv, mask, w = _inputs()
    log_probs = new.clone().requires_grad_(True)
    params = pl.PolicyLossParams(clip_low=0.1, clip_high=0.15, norm_length=T)
    counts = dict(num_tokens=int(mask.sum()), num_seqs=B)  # train_step's global counts: every row of the batch
    total = 0.0
    for start in range(0, B, rows_per_piece):
        rows = slice(start, start + rows_per_piece)
        # a piece is cut to its own longest response, as a micro-batch is
        width = max(int(mask[rows].sum(-1).max()), 1)
        loss, _ = pl.get_policy_loss(mode)(log_probs[rows, :width], old[rows, :width], adv[rows, :width],
                                           mask[rows, :width], params, agg_mode=agg, **counts,
                                           is_weights=w[rows, :width] if weights else None)
        loss.backward()
        total += float(loss.detach())
    return total, log_probs.grad


@pytest.mark.parametrize("mode", ["gspo", "geo_mean", "sapo", "vanilla", "cispo", "gpg"])
@pytest.mark.parametrize("agg", algos.AGG_MODES)
def test_any_split_gives_the_batch_loss_and_gradient(mode, agg):
    whole, grad = _loss_and_grad(mode, agg, B, weights=True)
    for rows in (1, 3, 4):  # micro-batches of 1, 3 (uneven) and 4 rows; 4 is also DP2's share of each rank
        part, part_grad = _loss_and_grad(mode, agg, rows, weights=True)
        assert part == pytest.approx(whole, rel=1e-5, abs=1e-6)
        torch.testing.assert_close(part_grad, grad, rtol=1e-5, atol=1e-7)
