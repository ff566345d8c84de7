"""Context parallelism (CP) for megappo's compute on the padded path, in megatron's sequence layout.

Layout (megatron's, so that its rotary embedding, `get_pos_emb_on_this_cp_rank`, slices the same positions): a
micro-batch's left-aligned rows (`ModelBatch.left_aligned`), padded at the right to a multiple of 2 * cp (times tp
with sequence parallelism), are cut into 2 * cp equal chunks along the sequence, and CP rank r runs chunks r and
2 * cp - 1 - r: causal attention costs every rank the same. The model runs on those [b, s / cp] tokens only.

Attention. transformer-engine's attention does CP itself (megatron's p2p / all-gather CP attention). megappo's
`SDPAttention` all-gathers K and V over the CP group (`gather_sequence`, autograd-aware) and attends each local
query to the global keys at or before its global position (`positions`): megatron's "all_gather" scheme, exact.

Outputs. The last stage turns its local output into per-position results first (log-probs and entropy from the
local logits and the local next tokens, or values), then all-gathers those [b, s / cp] results to the full [b, s]
(`CPSplit.gather`): the logits are never gathered. Every CP rank then reads the same response window and computes
the same loss; the gather's backward sums the gradient over the CP group (the adjoint of a gather whose result is
used on every rank), and `plan.gradient_undo` scales the loss for that. Sequence-level losses
(seq-mean aggregation, GSPO, value losses) thus see whole rows: nothing in a loss closure changes with CP.

Packed (THD) micro-batches are not split: with CP > 1 `plan.can_pack` is False and micro-batches run padded.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CPSplit", "positions", "causal_attend", "gather_sequence", "split_micro_batch", "cp_pad_multiple"]


def positions(seq_len: int, cp_size: int, cp_rank: int, device: Any = None) -> torch.Tensor:
    """Global positions [seq_len / cp] of CP rank `cp_rank`'s tokens: chunks r and 2cp-1-r of 2cp."""
    if seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2 * context_parallel_size = {2 * cp_size}")
    c = seq_len // (2 * cp_size)
    first, second = cp_rank * c, (2 * cp_size - 1 - cp_rank) * c
    return torch.cat([torch.arange(first, first + c, device=device), torch.arange(second, second + c, device=device)])


@functools.lru_cache(maxsize=64)
def _global_order(seq_len: int, cp_size: int, device: str) -> torch.Tensor:
    """Index into the rank-ordered concatenation of every CP rank's tokens that gives the global order (cached:
    every layer's K and V gather and every output gather of a micro-batch use the same one)."""
    gathered = torch.cat([positions(seq_len, cp_size, r, device) for r in range(cp_size)])
    return torch.argsort(gathered)


@functools.lru_cache(maxsize=64)
def causal_attend(seq_len: int, cp_size: int, cp_rank: int, device: str) -> torch.Tensor:
    """[seq_len / cp, seq_len] bool, True where this CP rank's query (a row) may attend to a key in global order:
    the key's position is at or before the query's (cached per length: every layer uses the same)."""
    q_pos = positions(seq_len, cp_size, cp_rank, device)
    return q_pos.unsqueeze(1) >= torch.arange(seq_len, device=device).unsqueeze(0)


class _GatherSequence(torch.autograd.Function):
    """All-gather along `dim` over `group` (rank order); backward: the gradient summed over the group, this rank's
    slice. torch.distributed.nn's all_gather falls back to an all-to-all on gloo that gloo lacks; this works on
    any backend."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        ctx.rank, ctx.size = dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(ctx.size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        n = grad.size(ctx.dim) // ctx.size
        return grad.narrow(ctx.dim, ctx.rank * n, n), None, None


def gather_sequence(x: torch.Tensor, dim: int, group: Any, seq_len: int) -> torch.Tensor:
    """Every CP rank's local tokens of `x` (along `dim`, this rank's `positions`) -> the full sequence of
    `seq_len` in global order; differentiable (gradients summed over the group)."""
    size = dist.get_world_size(group)
    full = _GatherSequence.apply(x, dim, group)
    return full.index_select(dim, _global_order(seq_len, size, str(x.device)))


def cp_pad_multiple(cp_size: int, tp_size: int, sequence_parallel: bool) -> int:
    """What a CP micro-batch's length is padded to: 2 * cp chunks, each local half split over TP with SP."""
    return 2 * cp_size * (tp_size if sequence_parallel else 1)


@dataclass
class CPSplit:
    """One micro-batch's split for this CP rank: what the last stage needs to put its outputs back together."""

    group: Any
    seq_len: int  # the padded full length
    targets: torch.Tensor  # [b, s / cp] the next token of each local position (left-aligned rows)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Per-position results [b, s / cp, ...] -> [b, s, ...] in global order (autograd-aware)."""
        return gather_sequence(local, 1, self.group, self.seq_len)


def split_micro_batch(input_ids: torch.Tensor, position_ids: torch.Tensor, parallel_state: Any,
                      multiple: int) -> tuple[torch.Tensor, torch.Tensor, CPSplit]:
    """Left-aligned [b, s] input_ids / position_ids -> this CP rank's [b, s_pad / cp] and the `CPSplit`.

    The right padding added is past every real token (rows are left-aligned), so under the causal mask no real
    token sees it; its outputs are never read."""
    b, s = input_ids.shape
    s_pad = -(-s // multiple) * multiple
    if s_pad != s:
        input_ids = torch.nn.functional.pad(input_ids, (0, s_pad - s))
        position_ids = torch.nn.functional.pad(position_ids, (0, s_pad - s))
    idx = positions(s_pad, parallel_state.cp_size, parallel_state.cp_rank, input_ids.device)
    targets = torch.roll(input_ids, -1, dims=1).index_select(1, idx)
    split = CPSplit(parallel_state.cp_group, s_pad, targets)
    return input_ids.index_select(1, idx), position_ids.index_select(1, idx), split
