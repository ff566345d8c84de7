"""Which response tokens the policy gradient trains on: the highest-entropy fraction ("forking tokens").

Wang et al. 2025 ("Beyond the 80/20 rule") train the policy gradient on the top 20% of a batch's tokens by the
policy's entropy and match or beat training on all of them; TRL calls the fraction `top_entropy_quantile`. A token
left out keeps its place in the loss's normaliser (its loss is zeroed, as TRL does), so the selection scales the
gradient down rather than re-weighting the chosen tokens.

The threshold is taken over the whole step's response tokens (every data-parallel rank's: the caller gathers
them), so the choice does not depend on how the batch is split into micro-batches or ranks.
"""
from __future__ import annotations

import math

import torch


def entropy_threshold(entropies: torch.Tensor, quantile: float) -> float:
    """The entropy of the k-th highest-entropy token, k = ceil(quantile * N), of the N valid tokens' entropies
    (1-D). Tokens at or above it are selected: the top `quantile` fraction (a tie at the threshold takes all of
    its tokens). -inf when quantile >= 1 or there are no tokens (everything selected)."""
    if not 0.0 < quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in (0, 1], got {quantile}")
    n = entropies.numel()
    if quantile >= 1.0 or n == 0:
        return float("-inf")
    k = max(1, math.ceil(quantile * n))
    # the k-th largest = the (n - k + 1)-th smallest; kthvalue has no size limit (torch.quantile stops at 2^24)
    return float(torch.kthvalue(entropies.detach().double().flatten().cpu(), n - k + 1).values)


def high_entropy_tokens(entropy: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """entropy, mask [B, R] -> [B, R] float: 1.0 where a response token's entropy is >= threshold, else 0."""
    return ((entropy.double() >= threshold) & mask.bool()).to(torch.float32)

