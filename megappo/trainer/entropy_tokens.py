"""The step's phase that chooses the tokens the policy gradient trains on (actor.policy_loss.top_entropy_quantile).

The old policy's entropy of every response token comes from the old log-prob forward; the threshold is taken over
the step's tokens on every data-parallel rank (gathered: each rank's [B, R] padded to the step's longest response),
so each rank's choice is the one a single rank holding the whole batch would make.
"""
from __future__ import annotations

import torch

from megappo.algos.token_selection import entropy_threshold, high_entropy_tokens
from megappo.parallel import ParallelState
from megappo.trainer.dp import dp_gather, dp_max, dp_sum
from megappo.trainer.experience import Experience


def choose_tokens(exp: Experience, entropy: torch.Tensor, quantile: float, ps: ParallelState) -> dict[str, float]:
    """Set `exp.train.pg_token_mask` [B, R] from the old policy's entropy [B, R]; returns the step's metrics."""
    mask = exp.mask
    b, r = mask.shape
    width = int(dp_max(r, ps))
    pad = (0, width - r)
    rows = dp_gather(torch.stack([torch.nn.functional.pad(entropy.double(), pad),
                                  torch.nn.functional.pad(mask.double(), pad)], 1), ps)  # [N, 2, width]
    valid = rows[:, 1] > 0
    threshold = entropy_threshold(rows[:, 0][valid], quantile)
    chosen = high_entropy_tokens(entropy, mask, threshold)
    exp.train.pg_token_mask = chosen.to(mask.device)
    picked, tokens = dp_sum([float(chosen.sum()), float(mask.sum())], ps)
    return {"actor/selected_token_fraction": picked / max(tokens, 1.0), "actor/entropy_threshold": threshold}
