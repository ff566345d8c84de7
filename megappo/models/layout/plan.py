"""A micro-batch's layout for the model: padded rows, one pack of its sequences, or this CP rank's chunks.

The plan (`plan_micro_batches`) decides once per step, from the model's attention and the parallel layout, which
layout the micro-batches run in, and lays out each one:

- `Padded`: the rows left-aligned ([b, s], `ModelBatch.left_aligned`), with the causal mask where megatron's local
  attention needs it passed (transformer-engine and megappo's `SDPAttention` apply it themselves);
- `Packed` (verl's use_remove_padding, `packing`): one pack [1, T] of the rows' real tokens with megatron's
  `PackedSeqParams`; where the attention runs packed sequences and there is no context parallelism. With prefix
  sharing (`prefix`) a micro-batch holding rows of one prompt is a shared pack instead: the prompt once, then each
  row's response (the same interface: inputs, packed params, `window` read-back);
- `ContextParallel` (`context_parallel`): this CP rank's two chunks [b, s / cp] of the left-aligned rows, padded to
  a multiple of 2 * cp (times tp under sequence parallelism).

The forward step gives the model `layout.inputs()`; the loss closures read the response window of the model's
output through `layout.values` / `layout.token_stats`, which return [b, R] tensors whatever the layout, so nothing
after them (log-probs, entropy, values, losses) knows how the micro-batch ran. Megatron's schedule is told the
activations' shape by `rows` and `seq_length`.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from megappo.models.batch import ModelBatch
from megappo.models.builder import unwrap
from megappo.models.layout.context_parallel import CPSplit, cp_pad_multiple, split_micro_batch
from megappo.models.microbatch import MicroBatching, MicroBatchPlan, padded_tokens, real_tokens, split_batch
from megappo.models.layout.packing import Pack, pack_micro_batch
from megappo.models.layout.prefix import prompt_groups, share_micro_batch, sharing_on
from megappo.models.layout.prefix_cp import PlainRows, TreeRows, tree_rows
from megappo.models.router_replay import replayer_of
from megappo.parallel import ParallelState

__all__ = ["Layout", "Padded", "Packed", "ContextParallel", "plan_micro_batches", "can_pack", "causal_mask", "model_device",
           "gradient_undo"]

# stats(logits [b, n, V/tp], next tokens [b, n]) -> per-position results [b, n] (None where not asked)
TokenStats = Callable[[torch.Tensor, torch.Tensor], Sequence[Optional[torch.Tensor]]]

_CAUSAL: dict[str, torch.Tensor] = {}  # device -> the mask of the longest length seen on it


def causal_mask(s: int, device: torch.device) -> torch.Tensor:
    """[1, 1, s, s] bool, True where attention is blocked (megatron's convention).

    megatron's local attention uses a given mask as-is; without one it builds the causal mask on device "cuda".
    Micro-batches are cropped to their own lengths, so one mask per device is kept at the longest length seen and
    sliced: a mask per length would pile up s^2 bytes for every length ever seen.
    """
    key = str(device)
    full = _CAUSAL.get(key)
    if full is None or full.shape[-1] < s:
        full = _CAUSAL[key] = torch.ones(s, s, dtype=torch.bool, device=device).triu_(1).view(1, 1, s, s)
    return full[..., :s, :s]


class Padded:
    """The micro-batch's rows left-aligned: every real token left of every padding token, so the causal mask alone
    is exact."""

    pack: Optional[Pack] = None

    def __init__(self, mb: ModelBatch, pass_mask: bool):
        self.input_ids, self.position_ids = mb.left_aligned()  # [b, s] each
        self.mask = causal_mask(mb.seq_len, self.input_ids.device) if pass_mask else None
        self.rows, self.seq_length = mb.batch_size, mb.seq_len

    def inputs(self) -> dict[str, Any]:
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "attention_mask": self.mask}

    def values(self, output: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        """output [b, s] -> [b, R] at the window's columns."""
        return output.gather(1, window)

    def token_stats(self, output: torch.Tensor, window: torch.Tensor, targets: torch.Tensor,
                    stats: TokenStats) -> Sequence[Optional[torch.Tensor]]:
        """output [b, s, V/tp] logits -> `stats` of the window's logits [b, R, V/tp] and the response tokens."""
        return stats(output.gather(1, window.unsqueeze(-1).expand(-1, -1, output.shape[-1])), targets)


class Packed:
    """The micro-batch as one pack [1, T] of its rows' real tokens; outputs read at each row's place in the pack."""

    def __init__(self, pack: Pack):
        self.pack = pack
        self.rows, self.seq_length = 1, pack.num_tokens

    def inputs(self) -> dict[str, Any]:
        return {"input_ids": self.pack.input_ids, "position_ids": self.pack.position_ids, "attention_mask": None,
                "packed_seq_params": self.pack.packed_seq_params()}

    def values(self, output: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        """output [1, T] -> [b, R]."""
        return self.pack.window(output, window)

    def token_stats(self, output: torch.Tensor, window: torch.Tensor, targets: torch.Tensor,
                    stats: TokenStats) -> Sequence[Optional[torch.Tensor]]:
        """output [1, T, V/tp] -> `stats` of the rows' window logits [b, R, V/tp] and the response tokens."""
        return stats(self.pack.window(output, window), targets)


class ContextParallel:
    """This CP rank's chunks of the micro-batch's rows (`prefix_cp`: as they are, or with each group of one prompt
    as one tree row). Per-position results are computed from the local output (the logits stay local) and
    all-gathered over the CP group to [n, s] before the window is read, so every CP rank returns, and computes the
    loss on, the whole micro-batch."""

    pack: Optional[Pack] = None

    def __init__(self, rows: Union[PlainRows, TreeRows], parallel_state: ParallelState, multiple: int):
        self.layout_rows = rows
        self.input_ids, self.position_ids, self.split = split_micro_batch(rows.input_ids, rows.position_ids,
                                                                          parallel_state, multiple)
        self.params = rows.params(self.split, parallel_state.cp_size, parallel_state.cp_rank)
        self.rows, self.seq_length = self.input_ids.shape[0], self.split.seq_len  # megatron divides seq_length by cp

    def inputs(self) -> dict[str, Any]:
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "attention_mask": None,
                "packed_seq_params": self.params}

    def values(self, output: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        """output [n, s / cp] -> [b, R]."""
        return self.layout_rows.window(self.split.gather(output), window)

    def token_stats(self, output: torch.Tensor, window: torch.Tensor, targets: torch.Tensor,
                    stats: TokenStats) -> Sequence[Optional[torch.Tensor]]:
        """output [n, s / cp, V/tp] -> `stats` of every local position and its next token, gathered, at the window
        ([b, R] each); `targets` (the response tokens) are the gathered positions' own."""
        split: CPSplit = self.split
        out = stats(output, split.targets)
        if any(t is not None and t.dim() > 2 for t in out):
            raise ValueError("per-position top-k log-probs are not computed under context parallelism (its ranks "
                             "gather per-token scalars only): set context_parallel_size=1")
        return [None if t is None else self.layout_rows.window(split.gather(t), window) for t in out]


def _context_parallel(plan: MicroBatchPlan, inner: nn.Module, parallel_state: ParallelState, shape_group: Any,
                      device: torch.device, share: bool) -> list[ContextParallel]:
    """Each micro-batch's CP layout; with `share`, micro-batches with a prompt in several rows run tree rows
    (`prefix_cp`), padded to one shape where megatron needs equal shapes (as `_packed`)."""
    multiple = cp_pad_multiple(parallel_state.cp_size, parallel_state.tp_size,
                               bool(getattr(inner.config, "sequence_parallel", False)))
    rows = [tree_rows(mb) if share and any(len(g) > 1 for g in prompt_groups(mb)) else PlainRows(mb)
            for mb in plan.micro_batches]
    if parallel_state.vpp_size or shape_group is not None:
        shapes = torch.tensor([list(r.input_ids.shape) for r in rows], dtype=torch.long, device=device)
        if parallel_state.vpp_size:
            shapes[:] = shapes.amax(0)
        if shape_group is not None and dist.get_world_size(shape_group) > 1:
            dist.all_reduce(shapes, op=dist.ReduceOp.MAX, group=shape_group)
        rows = [r.pad_to(*shape) for r, shape in zip(rows, shapes.tolist())]
    return [ContextParallel(r, parallel_state, multiple) for r in rows]


Layout = Union[Padded, Packed, ContextParallel]


def model_device(model_chunks: Sequence[nn.Module]) -> torch.device:
    return next(iter(model_chunks[0].parameters())).device


def _own_attention(inner: nn.Module) -> bool:
    """Whether the model's attention is transformer-engine's or megappo's SDPAttention: both apply the causal mask
    themselves (TE ignores one passed) and run packed and context-parallel micro-batches; megatron's local
    DotProductAttention does neither."""
    te = getattr(getattr(inner, "megappo_spec", None), "use_transformer_engine", False)
    return bool(te or getattr(inner, "megappo_sdpa_attention", False))


def can_pack(model_chunks: Sequence[nn.Module], parallel_state: ParallelState) -> bool:
    """Whether these chunks run packed (THD) micro-batches: megappo's SDPAttention (local spec) or
    transformer-engine attention, without context parallelism (TE's THD context parallelism: not wired yet)."""
    return _own_attention(unwrap(model_chunks[0])) and parallel_state.cp_size == 1


def gradient_undo(num_micro_batches: int, parallel_state: ParallelState) -> float:
    """What a micro-batch's loss share is multiplied by so that megatron's scaling leaves the mini-batch loss.

    Megatron's schedule divides each loss by the number of micro-batches and DDP averages the gradients over the
    data x context parallel ranks. Every CP rank computes the whole micro-batch's loss from all-gathered outputs,
    and the gather's backward sums the gradient over the CP group, while megatron's schedule multiplies the loss by
    cp (its loss functions see local tokens only): that leaves one division by cp."""
    return float(num_micro_batches * parallel_state.dp_size) / parallel_state.cp_size


def _count_multiple(parallel_state: ParallelState) -> int:
    # megatron's interleaved (virtual pipeline) schedule runs micro-batches in groups of the pipeline size
    return parallel_state.pp_size if parallel_state.vpp_size else 1


def _shape_group(inner: nn.Module, parallel_state: ParallelState) -> Any:
    # megatron's allgather MoE dispatcher all-gathers tokens over the expert-parallel ranks, which are data-parallel
    # peers with their own micro-batches: it needs the same [b, s] on each, so pad to the max over the DP group.
    if parallel_state.ep_size > 1 and getattr(inner.config, "moe_token_dispatcher_type", None) == "allgather":
        return parallel_state.dp_group
    return None


def _tp_multiple(inner: nn.Module, parallel_state: ParallelState) -> int:
    # sequence parallelism splits the tokens over the TP ranks
    return parallel_state.tp_size if getattr(inner.config, "sequence_parallel", False) else 1


def _packed(plan: MicroBatchPlan, inner: nn.Module, parallel_state: ParallelState, shape_group: Any,
            device: torch.device, share: bool) -> list[Packed]:
    """One pack per micro-batch, padded at the tail to one length where megatron needs equal shapes (virtual
    pipeline stages: every micro-batch; the allgather MoE dispatcher: micro-batch i over the data-parallel group).
    `share`: a micro-batch with a prompt in several rows runs as a shared pack (`prefix`)."""
    multiple = _tp_multiple(inner, parallel_state)
    makers = [share_micro_batch if share and any(len(g) > 1 for g in prompt_groups(mb)) else pack_micro_batch
              for mb in plan.micro_batches]
    packs = [make(mb, multiple=multiple) for make, mb in zip(makers, plan.micro_batches)]
    lens = torch.tensor([p.num_tokens for p in packs], dtype=torch.long, device=device)
    if parallel_state.vpp_size:
        lens[:] = lens.max()
    if shape_group is not None and dist.get_world_size(shape_group) > 1:
        dist.all_reduce(lens, op=dist.ReduceOp.MAX, group=shape_group)
    packs = [p if p.num_tokens == n else make(mb, pack_len=n, multiple=multiple)
             for p, make, mb, n in zip(packs, makers, plan.micro_batches, lens.tolist())]
    return [Packed(p) for p in packs]


def plan_micro_batches(model_chunks: Sequence[nn.Module], batch: ModelBatch, micro: MicroBatching,
                       parallel_state: ParallelState) -> MicroBatchPlan:
    """Micro-batches for megatron's schedule, on the model's device, each with its layout (`plan.layouts`).

    Packed when `micro.packed` and the attention runs packs without context parallelism (`can_pack`), with the
    rows of one prompt kept together and their prompt run once where `micro.share_prefix` asks (`prefix`); split
    over the CP group with context parallelism; padded otherwise."""
    inner = unwrap(model_chunks[0])
    if parallel_state.cp_size > 1 and not _own_attention(inner):
        raise NotImplementedError(
            f"context_parallel_size={parallel_state.cp_size} needs transformer-engine's attention or megappo's "
            "SDPAttention (megatron's DotProductAttention refuses CP); set context_parallel_size=1")
    device = model_device(model_chunks)
    packed = micro.packed and can_pack(model_chunks, parallel_state)
    shape_group = _shape_group(inner, parallel_state)
    share = sharing_on(micro.share_prefix, inner, parallel_state.cp_size, packed, batch,
                       replaying=bool(getattr(replayer_of(inner), "routers", None)))
    plan = split_batch(batch, micro_batch_size=micro.micro_batch_size, max_token_len=micro.max_token_len,
                       use_dynamic_bsz=micro.use_dynamic_bsz, dp_group=parallel_state.dp_group,
                       count_multiple=_count_multiple(parallel_state),
                       uniform_shape=bool(parallel_state.vpp_size) and not packed,
                       shape_group=None if packed else shape_group, comm_device=device,
                       cost=real_tokens if packed else padded_tokens, units=prompt_groups(batch) if share else None)
    plan.micro_batches = [mb.to(device) for mb in plan.micro_batches]
    if packed:
        plan.layouts = _packed(plan, inner, parallel_state, shape_group, device, share)
    elif parallel_state.cp_size > 1:
        plan.layouts = _context_parallel(plan, inner, parallel_state, shape_group, device, share)
    else:
        plan.layouts = [Padded(mb, pass_mask=not _own_attention(inner)) for mb in plan.micro_batches]
    return plan
