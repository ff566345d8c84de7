"""Top-k log-probs over a vocabulary sharded by tensor parallelism: the teacher's k most likely tokens at each
position, and the student's log-probs of those same tokens (top-k logit distillation).

Each TP rank holds logits [..., V/tp] of its contiguous vocabulary slice (see `megappo.models.vocab_parallel`).
The log-softmax's normaliser is assembled from per-position scalars (the max, the sum of exponentials); the top-k
from each shard's own top-k, gathered ([..., tp * k] per position) and cut to k. The student's side is
differentiable: its collectives sum forward and pass the gradient through unchanged backward (every TP rank computes
the same loss and back-propagates into its own shard), as megatron's `reduce_from_tensor_model_parallel_region`.
Columns past the real vocabulary (TP padding of the output layer) are not tokens: probability 0.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megappo.models.vocab_parallel import _tp_rank_size


class _SumOverRanks(torch.autograd.Function):
    """all-reduce(sum) forward, identity backward (each rank's loss is the same number)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:  # noqa: D401
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _sum(x: torch.Tensor, group, size: int) -> torch.Tensor:
    return _SumOverRanks.apply(x, group) if size > 1 else x


def _masked(logits: torch.Tensor, start: int, vocab_size: Optional[int]) -> torch.Tensor:
    x = logits.float()
    shard = x.shape[-1]
    if vocab_size is not None and start + shard > vocab_size:
        x = x.clone() if x is logits else x
        x[..., max(vocab_size - start, 0):] = float("-inf")
    return x


def _log_normaliser(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """[...] logsumexp over the whole vocabulary of this shard's x [..., V/tp] (differentiable in x)."""
    m = x.detach().amax(-1)
    if size > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    total = _sum((x - m.unsqueeze(-1)).exp().sum(-1), group, size)
    return m + total.log()


@torch.no_grad()
def vocab_parallel_topk(logits: torch.Tensor, k: int, tp_group: Optional[dist.ProcessGroup], *,
                        vocab_size: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens at each position: (log-probs [..., k] fp32, descending; global ids [..., k] long),
    identical on every TP rank. logits: [..., V/tp] this rank's slice."""
    rank, size = _tp_rank_size(tp_group)
    shard = logits.shape[-1]
    x = _masked(logits, rank * shard, vocab_size)
    lse = _log_normaliser(x, tp_group, size)
    vals, ids = x.topk(min(k, shard), dim=-1)
    ids = ids + rank * shard
    if size > 1:
        all_vals, all_ids = [torch.empty_like(vals) for _ in range(size)], [torch.empty_like(ids) for _ in range(size)]
        dist.all_gather(all_vals, vals.contiguous(), group=tp_group)
        dist.all_gather(all_ids, ids.contiguous(), group=tp_group)
        vals, pick = torch.cat(all_vals, -1).topk(k, dim=-1)
        ids = torch.cat(all_ids, -1).gather(-1, pick)
    if vals.shape[-1] < k:
        raise ValueError(f"top-{k} of a vocabulary of {vals.shape[-1]} tokens: set distillation.distillation_loss."
                         f"topk to at most the vocabulary size")
    return vals - lse.unsqueeze(-1), ids


def vocab_parallel_log_probs_at(logits: torch.Tensor, ids: torch.Tensor, tp_group: Optional[dist.ProcessGroup], *,
                                vocab_size: Optional[int] = None, temperature: float = 1.0) -> torch.Tensor:
    """log p(ids) [..., k] fp32 under the softmax of logits / temperature [..., V/tp] (this rank's slice), for
    global token ids [..., k]; differentiable in `logits`, identical on every TP rank."""
    rank, size = _tp_rank_size(tp_group)
    shard = logits.shape[-1]
    start = rank * shard
    x = _masked(logits / temperature if temperature != 1.0 else logits, start, vocab_size)
    lse = _log_normaliser(x, tp_group, size)
    local = ids - start
    here = (local >= 0) & (local < shard)
    picked = x.gather(-1, local.clamp(0, shard - 1))
    picked = torch.where(here, picked, torch.zeros((), dtype=picked.dtype))  # 0 where another rank holds the id
    return _sum(picked, tp_group, size) - lse.unsqueeze(-1)
