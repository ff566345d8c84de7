"""Split a batch into micro-batches, by count or by a token budget, and put per-token outputs back in order.

Each micro-batch is cropped to its own padding: prompts left-padded only to the micro-batch's longest prompt and
responses right-padded only to its longest response, so short sequences grouped together cost little. Cropping
removes padding columns only; position ids travel with their tokens and padding is masked out of attention, so
the model's per-token outputs do not depend on how sequences were grouped.

With a token budget (`use_dynamic_bsz`, verl's `ppo_max_token_len_per_gpu`) the budget bounds what the model
allocates (`TokenCost`): the *padded* micro-batch, rows x (prompt + response columns), or, when micro-batches run
packed (verl's use_remove_padding, see `megappo.models.layout.plan`), the sum of the rows' real tokens.

Megatron's pipeline schedule runs the same number of micro-batches on every rank that shares a step, so the count
is all-reduced (max) over the data-parallel group and ranks with fewer split their largest micro-batches.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from megappo.models.batch import ModelBatch

__all__ = ["MicroBatching", "MicroBatchPlan", "TokenCost", "padded_tokens", "real_tokens", "split_batch",
           "plan_groups"]


@dataclass
class MicroBatching:
    """How a batch is cut into micro-batches (verl's names: *_micro_batch_size_per_gpu, use_dynamic_bsz,
    *_max_token_len_per_gpu)."""

    micro_batch_size: Optional[int] = None  # sequences per micro-batch; None: the whole batch at once
    use_dynamic_bsz: bool = False  # group by a token budget instead
    max_token_len: Optional[int] = None  # tokens per micro-batch with use_dynamic_bsz (padded, or packed)
    # verl's use_remove_padding: each micro-batch runs as one pack of its sequences without padding (THD,
    # megappo.models.layout.plan) where the attention supports it (SDPAttention, transformer-engine); padded otherwise
    packed: bool = False
    # actor_rollout_ref.model.use_prefix_sharing: packed micro-batches run each prompt shared by several rows once
    # (megappo.models.layout.prefix). None: where it pays (`prefix.sharing_pays`); True: wherever a prompt repeats
    # (an error where the model cannot); False: never
    share_prefix: Optional[bool] = False


# cost(rows, longest prompt, longest response, real tokens) -> the tokens the model runs on for a micro-batch
TokenCost = Callable[[int, int, int, int], int]


def padded_tokens(rows: int, prompt_len: int, response_len: int, real: int) -> int:
    """A padded micro-batch: rows x (prompt + response columns)."""
    return rows * (prompt_len + response_len)


def real_tokens(rows: int, prompt_len: int, response_len: int, real: int) -> int:
    """A packed micro-batch: its rows' real tokens."""
    return real


@dataclass
class MicroBatchPlan:
    """Micro-batches of one batch and where their rows came from."""

    micro_batches: list[ModelBatch]  # each [b_i, p_i + r_i], cropped to its own padding (or all one shape)
    indices: list[torch.Tensor]  # [b_i] long: rows of the original batch, in micro-batch order
    batch_size: int  # B of the original batch
    response_len: int  # R of the original batch
    layouts: list[Any] = field(default_factory=list)  # each micro-batch's megappo.models.layout layout, in order

    def __len__(self) -> int:
        return len(self.micro_batches)

    @property
    def permutation(self) -> torch.Tensor:
        """[B] original row of each row of the concatenated micro-batches."""
        return torch.cat(self.indices)

    def restore(self, outputs: Sequence[torch.Tensor], fill: float = 0.0) -> torch.Tensor:
        """Scatter per-micro-batch outputs [b_i, r_i, ...] back into [B, R, ...] in the original row order.

        Columns beyond a micro-batch's own response length (padding) get `fill`.
        """
        if len(outputs) != len(self.indices):
            raise ValueError(f"restore got {len(outputs)} outputs for {len(self.indices)} micro-batches")
        ref = outputs[0]
        out = torch.full((self.batch_size, self.response_len, *ref.shape[2:]), fill, dtype=ref.dtype,
                         device=ref.device)
        for idx, o in zip(self.indices, outputs):
            out[idx.to(o.device), : o.shape[1]] = o[: len(idx)]  # rows past len(idx): shape padding
        return out


def _cost(group: list[int], plen: list[int], rlen: list[int], cost: TokenCost) -> int:
    """Tokens the model runs on for a micro-batch of these rows."""
    return cost(len(group), max(plen[i] for i in group), max(rlen[i] for i in group),
                sum(plen[i] + rlen[i] for i in group))


def _greedy(order: list[int], plen: list[int], rlen: list[int], budget: int,
            cost: TokenCost = padded_tokens) -> list[list[int]]:
    """Contiguous groups of `order` whose `cost` stays within `budget`.

    The cost only grows as a group is extended, so filling greedily gives the fewest groups for a budget.
    """
    groups: list[list[int]] = []
    cur: list[int] = []
    mp = mr = tot = 0
    for i in order:
        np_, nr, nt = max(mp, plen[i]), max(mr, rlen[i]), tot + plen[i] + rlen[i]
        if cur and cost(len(cur) + 1, np_, nr, nt) > budget:
            groups.append(cur)
            cur, np_, nr, nt = [], plen[i], rlen[i], plen[i] + rlen[i]
        cur.append(i)
        mp, mr, tot = np_, nr, nt
    if cur:
        groups.append(cur)
    return groups


def plan_groups(plen: list[int], rlen: list[int], max_token_len: int,
                num_groups: Optional[int] = None, cost: TokenCost = padded_tokens) -> list[list[int]]:
    """Group rows into micro-batches of `cost` <= `max_token_len`, balanced, longest first.

    Rows are sorted by length, so similar lengths share a micro-batch (little padding). Without `num_groups` the
    fewest groups that fit are returned; with it (>= that minimum) exactly `num_groups`: the smallest budget that
    fits in that many contiguous groups is found by bisection, which evens out the micro-batches' costs.
    """
    n = len(plen)
    longest = max((p + r for p, r in zip(plen, rlen)), default=0)
    if longest > max_token_len:
        raise ValueError(
            f"a sequence has {longest} tokens but the micro-batch token budget is {max_token_len}; raise "
            "ppo_max_token_len_per_gpu (or log_prob_max_token_len_per_gpu) to at least the longest prompt + response"
        )
    order = sorted(range(n), key=lambda i: (-(plen[i] + rlen[i]), i))
    groups = _greedy(order, plen, rlen, max_token_len, cost)
    if num_groups is None or num_groups == len(groups):
        return groups
    if num_groups < len(groups):
        raise ValueError(f"{num_groups} micro-batches cannot hold the batch within {max_token_len} tokens")
    if num_groups > n:
        raise _too_few_sequences(n, num_groups, " (balance the batch across ranks or raise the budget)")
    lo, hi = max(longest, 1), max_token_len  # greedy(hi) fits in <= num_groups; find the smallest such budget
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_greedy(order, plen, rlen, mid, cost)) <= num_groups:
            hi = mid
        else:
            lo = mid + 1
    groups = _greedy(order, plen, rlen, lo, cost)
    while len(groups) < num_groups:  # the bisection can land on fewer groups: split the costliest in two
        k = max((g for g in range(len(groups)) if len(groups[g]) > 1),
                key=lambda g: _cost(groups[g], plen, rlen, cost))
        g = groups.pop(k)
        groups[k:k] = [g[: len(g) // 2], g[len(g) // 2:]]
    return groups


def _too_few_sequences(n: int, count: int, more: str = "") -> ValueError:
    return ValueError(f"this rank has {n} sequences but the data-parallel group needs {count} micro-batches; give "
                      f"every rank at least as many sequences as micro-batches{more}")


def _split_to(groups: list[list[int]], count: int) -> list[list[int]]:
    """Split the largest groups in half until there are `count` (fixed-size micro-batches, uneven DP ranks)."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        k = max(range(len(groups)), key=lambda g: len(groups[g]))
        if len(groups[k]) < 2:
            raise _too_few_sequences(sum(map(len, groups)), count)
        g = groups.pop(k)
        groups[k:k] = [g[: len(g) // 2], g[len(g) // 2:]]
    return groups


def _unit_rows(units: list[list[int]], plen: list[int], rlen: list[int],
               budget: Optional[int]) -> tuple[list[list[int]], list[int], list[int]]:
    """Units of rows cut to fit `budget` (None: whole), and each one's (shared prompt, summed responses) lengths:
    a unit costs its prompt once (prefix sharing's groups)."""
    out: list[list[int]] = []
    for unit in units:
        cur: list[int] = []
        for i in unit:
            if cur and budget and plen[cur[0]] + sum(rlen[j] for j in cur) + rlen[i] > budget:
                out.append(cur)
                cur = []
            cur.append(i)
        out.append(cur)
    return out, [plen[u[0]] for u in out], [sum(rlen[i] for i in u) for u in out]


def _dynamic_groups(plen: list[int], rlen: list[int], budget: int, count: Optional[int], cost: TokenCost,
                    units: Optional[list[list[int]]]) -> list[list[int]]:
    """plan_groups over rows, or over `units` (rows that share a prompt, kept together where they fit)."""
    if units is None:
        return plan_groups(plen, rlen, budget, count, cost=cost)
    cut, uplen, urlen = _unit_rows(units, plen, rlen, budget)
    if count is not None and count > len(cut):
        return plan_groups(plen, rlen, budget, count, cost=cost)  # more micro-batches than units: rows alone
    return [[i for u in g for i in cut[u]] for g in plan_groups(uplen, urlen, budget, count, cost=cost)]


def split_batch(
    batch: ModelBatch,
    *,
    micro_batch_size: Optional[int] = None,
    max_token_len: Optional[int] = None,
    use_dynamic_bsz: bool = False,
    dp_group: Optional[dist.ProcessGroup] = None,
    count_multiple: int = 1,
    uniform_shape: bool = False,
    shape_group: Optional[dist.ProcessGroup] = None,
    comm_device: Union[str, torch.device] = "cpu",
    cost: TokenCost = padded_tokens,
    units: Optional[list[list[int]]] = None,
) -> MicroBatchPlan:
    """Split `batch` into micro-batches with the same count on every rank of `dp_group`.

    Fixed: rows in order, `micro_batch_size` per micro-batch (None: one micro-batch). Dynamic
    (`use_dynamic_bsz`): rows grouped by length so each micro-batch's padded tokens stay within `max_token_len`.
    Every micro-batch is cropped to its own longest prompt and response. `dp_group`: the ranks that must agree on
    the count (None: this process only). `count_multiple`: round the count up to a multiple of it (megatron's
    interleaved pipeline schedule runs micro-batches in groups of the pipeline size). `uniform_shape`: pad every
    micro-batch to one [rows, P + R] (all-padding rows appended) for pipelines that cannot exchange shapes.
    `shape_group`: pad micro-batch i to its largest shape on any rank of this group (collectives that need equal
    sizes across ranks, e.g. megatron's allgather MoE token dispatcher under expert parallelism).
    `comm_device`: where the few integers of those collectives live ("cuda" for NCCL groups).
    `cost`: what the token budget counts (`real_tokens` for packed micro-batches).
    `units`: rows to keep in one micro-batch (prefix sharing's prompt groups, each prompt counted once by the
    budget): fixed micro-batches take the rows unit after unit, dynamic ones plan over units.
    """
    plen_t = batch.prompt_lengths()
    rlen_t = batch.response_lengths()
    # Keep at least one prompt column (the first response token's logit comes from the last prompt position) and
    # one response column, so every micro-batch has a well-formed [b, R_i] output.
    plen = [max(int(v), min(1, batch.prompt_len)) for v in plen_t.tolist()]
    rlen = [max(int(v), min(1, batch.response_len)) for v in rlen_t.tolist()]
    n = batch.batch_size
    if n == 0:
        raise ValueError("split_batch: the batch has no rows")

    if use_dynamic_bsz:
        if not max_token_len or max_token_len <= 0:
            raise ValueError("use_dynamic_bsz=true needs a positive ppo_max_token_len_per_gpu")
        groups = _dynamic_groups(plen, rlen, max_token_len, None, cost, units)
    else:
        if micro_batch_size is not None and micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}; set "
                             "ppo_micro_batch_size_per_gpu (or log_prob_micro_batch_size_per_gpu) >= 1")
        mbs = micro_batch_size or n
        order = [i for u in units for i in u] if units is not None else list(range(n))
        groups = [order[s:s + mbs] for s in range(0, n, mbs)]

    count = len(groups)
    if dp_group is not None and dist.is_initialized() and dist.get_world_size(dp_group) > 1:
        t = torch.tensor([count], dtype=torch.long, device=comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=dp_group)
        count = int(t.item())
    count = -(-count // count_multiple) * count_multiple
    if count > len(groups):
        groups = (_dynamic_groups(plen, rlen, max_token_len, count, cost, units) if use_dynamic_bsz
                  else _split_to(groups, count))
    return _crop_groups(batch, groups, plen, rlen, uniform_shape, shape_group, comm_device)


def _crop_groups(batch: ModelBatch, groups: list[list[int]], plen: list[int], rlen: list[int], uniform_shape: bool,
                 shape_group: Optional[dist.ProcessGroup], comm_device: Union[str, torch.device]) -> MicroBatchPlan:
    """The plan of these row groups: each micro-batch cropped to its own padding, then grown to the shapes asked."""
    micro, indices = [], []
    for g in groups:
        idx = torch.tensor(sorted(g), dtype=torch.long)
        p = max(plen[i] for i in g)
        r = max(rlen[i] for i in g)
        micro.append(batch.select(idx).crop(p, r))
        indices.append(idx)
    shapes = torch.tensor([[mb.batch_size, mb.prompt_len, mb.response_len] for mb in micro], dtype=torch.long)
    if uniform_shape:
        shapes[:] = shapes.amax(0)
    if shape_group is not None and dist.is_initialized() and dist.get_world_size(shape_group) > 1:
        shapes = shapes.to(comm_device)
        dist.all_reduce(shapes, op=dist.ReduceOp.MAX, group=shape_group)
    micro = [mb.pad_to(*shape) for mb, shape in zip(micro, shapes.tolist())]
    return MicroBatchPlan(micro, indices, batch.batch_size, batch.response_len)
