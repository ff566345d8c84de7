"""Log-probs of target tokens, entropy and sum_v p_v^2 from logits sharded over the vocabulary by tensor parallelism.

Each TP rank holds logits [..., V/tp] for its contiguous slice of the (padded) vocabulary, as megatron's
ColumnParallelLinear output layer leaves them (`parallel_output=True`). Like megatron's
`vocab_parallel_cross_entropy`, only per-token scalars cross ranks (the max, the sum of exponentials, the target
logit, the entropy term and, when asked, the sum of squared exponentials), so no rank ever materialises full-vocabulary logits.

    log p(y)  = x_y - logsumexp(x)
    entropy   = -sum_v p_v log p_v             (each rank sums over its shard, then one all-reduce)
    d logp/dx = onehot(y) - p
    d H/dx    = -p * (log p + H)
    sum_v p_v^2 = sum_v e_v^2 / (sum_v e_v)^2  (e = exp(x - max); forward only, when asked: the optimal token
                                               baselines' input; in the sum of exponentials' all-reduce)

The softmax of the shard is the only [..., V/tp] tensor kept for backward, and the backward writes the gradient
into its storage; other temporaries are taken a row chunk at a time. Besides the logits shard itself the path
therefore holds one shard-sized buffer.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["vocab_parallel_log_probs", "vocab_parallel_log_probs_and_entropy", "vocab_parallel_token_stats"]


def _tp_rank_size(tp_group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    if tp_group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(tp_group), dist.get_world_size(tp_group)


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp_group, with_entropy, vocab_size, with_sum_p2=False):  # noqa: D401
        in_dtype = logits.dtype
        rank, size = _tp_rank_size(tp_group)
        shard = logits.shape[-1]
        start = rank * shard
        # Softmax statistics in fp32 even for bf16 logits: logsumexp over 150k entries loses digits in bf16.
        x = logits.float() if in_dtype != torch.float32 else logits.clone()
        if vocab_size is not None and start + shard > vocab_size:
            # Columns past the real vocabulary (padding for TP divisibility) are not tokens: probability 0, as in
            # the Hugging Face model and the rollout engine.
            x[..., max(vocab_size - start, 0):] = float("-inf")
        x_max = x.amax(-1)  # [...]
        if size > 1:
            dist.all_reduce(x_max, op=dist.ReduceOp.MAX, group=tp_group)
        x.sub_(x_max.unsqueeze(-1))

        in_shard = (target >= start) & (target < start + shard)  # [...]
        local_t = (target - start).clamp(0, shard - 1)
        tgt = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1)
        tgt = torch.where(in_shard, tgt, torch.zeros((), dtype=tgt.dtype))  # [...] shifted target logit or 0

        p = x.exp_()  # x is no longer needed: reuse its storage for exp, then for the softmax
        # sum_v p_v^2 = sum_v e_v^2 / (sum_v e_v)^2: the shard's sum of squares joins the same collective
        # (e_v <= 1 after the global max, and the max's own term is 1: no overflow, no underflow to 0)
        parts = [p.sum(-1), tgt] + ([torch.linalg.vector_norm(p, dim=-1).square()] if with_sum_p2 else [])
        stats = torch.stack(parts)  # [2 or 3, ...] one collective for all
        if size > 1:
            dist.all_reduce(stats, group=tp_group)
        sum_exp, tgt = stats[0], stats[1]
        log_probs = tgt - sum_exp.log()  # [...]
        sum_p2 = stats[2] / sum_exp.square() if with_sum_p2 else torch.zeros_like(log_probs)
        p.div_(sum_exp.unsqueeze(-1))

        entropy = None
        if with_entropy:
            # this shard's part of -sum p log p (xlogy: 0 log 0 = 0 for underflowed p), in row chunks so the
            # temporary is a slice, not another [..., V/tp] tensor
            p2, ent = p.view(-1, shard), torch.empty(p.shape[:-1]).view(-1)
            for rows in _row_chunks(p2.shape[0], shard):
                ent[rows] = -torch.xlogy(p2[rows], p2[rows]).sum(-1)
            entropy = ent.view(p.shape[:-1])
            if size > 1:
                dist.all_reduce(entropy, group=tp_group)

        ctx.in_dtype = in_dtype
        ctx.with_entropy = with_entropy
        ctx.save_for_backward(p, in_shard, local_t, entropy if with_entropy else torch.empty(0))
        if entropy is None:
            entropy = torch.zeros_like(log_probs)
        ctx.mark_non_differentiable(sum_p2)  # an advantage-estimator input, never trained through
        return log_probs, entropy, sum_p2

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, _grad_sum_p2):
        p, in_shard, local_t, entropy = ctx.saved_tensors
        shard = p.shape[-1]
        # The gradient is written into p's storage (p is not needed afterwards), a row chunk at a time:
        #   (onehot - p) g_logp  -  p (log p + H) g_H
        p2 = p.view(-1, shard)
        g_logp = (grad_logp if grad_logp is not None else torch.zeros(p.shape[:-1])).float().reshape(-1, 1)
        use_ent = ctx.with_entropy and grad_entropy is not None
        if use_ent:
            g_ent, ent = grad_entropy.float().reshape(-1, 1), entropy.reshape(-1, 1)
        onehot = local_t.reshape(-1, 1)
        hit = (g_logp * in_shard.reshape(-1, 1)).float()
        for rows in _row_chunks(p2.shape[0], shard):
            pc = p2[rows]
            ent_term = torch.xlogy(pc, pc).addcmul_(pc, ent[rows]).mul_(-g_ent[rows]) if use_ent else None
            pc.mul_(-g_logp[rows]).scatter_add_(-1, onehot[rows], hit[rows])
            if ent_term is not None:
                pc.add_(ent_term)
        return p.to(ctx.in_dtype), None, None, None, None, None


CHUNK_BYTES = 64 << 20  # fp32 bytes per row chunk of the temporaries


def _row_chunks(n_rows: int, row_len: int) -> list[slice]:
    """Row slices of about CHUNK_BYTES of fp32 each."""
    step = max(1, CHUNK_BYTES // (4 * max(row_len, 1)))
    return [slice(i, min(i + step, n_rows)) for i in range(0, n_rows, step)]


def vocab_parallel_log_probs_and_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp_group: Optional[dist.ProcessGroup],
    *,
    calculate_entropy: bool = True,
    vocab_size: Optional[int] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per-token log p(target) and entropy from this rank's vocabulary shard of the logits.

    logits: [..., V/tp] this rank's contiguous slice (rank r holds ids [r*V/tp, (r+1)*V/tp)); any float dtype.
    target: [...] long, global token ids. vocab_size: the real vocabulary; ids at or past it (TP padding of the
    output layer) get probability 0. tp_group: the tensor-parallel group (None or size 1: no communication).
    Returns (log_probs [...] fp32, entropy [...] fp32 or None), identical on every TP rank; both differentiable
    with respect to `logits`.
    """
    return vocab_parallel_token_stats(logits, target, tp_group, calculate_entropy=calculate_entropy,
                                      vocab_size=vocab_size)[:2]


def vocab_parallel_token_stats(
    logits: torch.Tensor, target: torch.Tensor, tp_group: Optional[dist.ProcessGroup], *,
    calculate_entropy: bool = True, calculate_sum_pi_squared: bool = False, vocab_size: Optional[int] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """`vocab_parallel_log_probs_and_entropy`, and with calculate_sum_pi_squared sum_v p_v^2 [...] fp32 too (verl's
    calculate_sum_pi_squared: the optimal token baselines' input), the shards' sums of squared exponentials
    riding in the softmax's one all-reduce. The sum carries no gradient.
    Returns (log_probs, entropy or None, sum_pi_squared or None)."""
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} must be target's shape {tuple(target.shape)} + [V/tp]")
    logp, ent, sq = _VocabParallelLogProbs.apply(logits, target, tp_group, calculate_entropy, vocab_size,
                                                 calculate_sum_pi_squared)
    return logp, (ent if calculate_entropy else None), (sq if calculate_sum_pi_squared else None)


def vocab_parallel_log_probs(
    logits: torch.Tensor, target: torch.Tensor, tp_group: Optional[dist.ProcessGroup],
    vocab_size: Optional[int] = None,
) -> torch.Tensor:
    """Per-token log p(target) [...] from vocabulary-sharded logits [..., V/tp] (as
    `vocab_parallel_log_probs_and_entropy`)."""
    return vocab_parallel_log_probs_and_entropy(logits, target, tp_group, calculate_entropy=False,
                                                vocab_size=vocab_size)[0]
