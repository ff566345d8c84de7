"""Prefix sharing under context parallelism: a GRPO group's prompt runs once in a padded, CP-split row.

Context-parallel micro-batches run padded (`context_parallel`): rows [n, s], each CP rank holding chunks r and
2cp-1-r of every row, per-position outputs (log-probs from the local logits and the local next tokens, entropy,
values) all-gathered to [n, s]. A THD pack's shared tree (`prefix`) cannot run there: its last prompt position
predicts every response's first token, one position with several next-token labels. So each group of rows with one
prompt (`prompt_groups`, more than one row with tokens) becomes ONE row (`TreeRows`):

    [prompt without its last token | last prompt token, response 1 | last prompt token, response 2 | ...]

Each branch starts with its own copy of the last prompt token, so every position has exactly one next token (the
next one in its row) and the CP path's per-position outputs need no change. Every other row stays as it is.

- attention (`TreeRowParams.attend_mask`): in global row positions, a query sees the keys at or before it in the
  shared prompt (segment 0) or in its own branch (segment k), never another branch; a row alone is all segment 0,
  so plain causal. Right padding has segment -1 (it sees the prompt and padding; never read). One [n, 1, s/cp, s]
  bool mask per micro-batch, built once and read by every layer (`attention.ContextParallelSequences`);
- positions (`TreeRowParams.rotary_table`): a branch's tokens have positions P-1, P, ... as if it followed its
  prompt alone; megatron's rotary table is cut to this CP rank's chunks by row position, so
  `prefix.install_prefix_positions`'s hook rebuilds the whole table and reads each local token's own position, one
  row of the table per token and row ([s/cp, n, 1, d], which megatron's bshd rope broadcasts over the heads).
  Learned absolute embeddings read `position_ids`, which carry the same positions;
- read-back (`TreeRows.window`): row i's left-aligned column c is its group row's column c in the shared prompt and
  the branch's column past it, so the [b, R] windows read what the unshared rows read.

The params ride megatron's `packed_seq_params` with qkv_format "sbhd" (no THD path is taken; the rotary length is
their `max_seqlen_q`, the padded row length). Saving: the prompt's P - 1 tokens per extra row, as the packed trees.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

from megappo.models.batch import ModelBatch
from megappo.models.layout.context_parallel import positions
from megappo.models.layout.prefix import prompt_groups

__all__ = ["TreeRows", "TreeRowParams", "PlainRows", "tree_rows"]


@dataclass
class TreeRowParams(PackedSeqParams):
    """One CP micro-batch's tree rows for the model (megatron's `packed_seq_params`, qkv_format "sbhd")."""

    segments: Optional[Tensor] = None  # [n, s] long, whole rows: 0 prompt / row alone, k branch k, -1 padding
    rotary_positions: Optional[Tensor] = None  # [n, s / cp] long: this CP rank's tokens' positions
    cp_size: int = 1
    cp_rank: int = 0
    _mask: Any = field(default=None, repr=False)  # (device, [n, 1, s / cp, s] bool), built at the first layer

    def attend_mask(self, device: torch.device) -> Tensor:
        """[n, 1, s / cp, s] bool, True where this CP rank's query may attend to a key (global row order)."""
        if self._mask is None or self._mask[0] != str(device):
            seg = self.segments.to(device)
            s = seg.size(1)
            q_pos = positions(s, self.cp_size, self.cp_rank, device)  # [s / cp]
            causal = q_pos.unsqueeze(1) >= torch.arange(s, device=device).unsqueeze(0)  # [s / cp, s]
            k_seg = seg.unsqueeze(1)  # [n, 1, s]
            q_seg = seg.index_select(1, q_pos).unsqueeze(2)  # [n, s / cp, 1]
            self._mask = (str(device), (causal & ((k_seg == 0) | (k_seg == q_seg))).unsqueeze(1))
        return self._mask[1]

    def rotary_table(self, rotary: Any, output: Tensor) -> Tensor:
        """megatron's rotary table of this rank's chunks [s / cp, 1, 1, d] -> each local token's own row
        [s / cp, n, 1, d] (the whole table rebuilt: megatron's is cut by row position)."""
        full = rotary.get_emb(self.max_seqlen_q)[:, 0]  # [s, 1, d]
        return full[self.rotary_positions.t().to(full.device)]


@dataclass
class TreeRows:
    """A micro-batch's rows with each shared group as one row (module doc), right-padded to [n, s]."""

    input_ids: Tensor  # [n, s] long
    position_ids: Tensor  # [n, s] long: each token's position as in its own row (padding: 0)
    segments: Tensor  # [n, s] long (TreeRowParams.segments)
    read_rows: Tensor  # [b] long: the row holding micro-batch row i
    read_cols: Tensor  # [b, S] long: its column of row i's left-aligned column c (past its last token: that one)

    def pad_to(self, rows: int, seq_len: int) -> "TreeRows":
        """Padded with whole padding rows and columns to [rows, seq_len] (equal shapes where megatron needs them)."""
        n, s = self.input_ids.shape
        pad = (0, seq_len - s, 0, rows - n)
        f = torch.nn.functional.pad
        return TreeRows(f(self.input_ids, pad), f(self.position_ids, pad), f(self.segments, pad, value=-1),
                        self.read_rows, self.read_cols)

    def params(self, split: Any, cp_size: int, cp_rank: int) -> TreeRowParams:
        """The model's params for this CP rank (`split`: `context_parallel.CPSplit` of these rows)."""
        s = split.seq_len
        seg = torch.nn.functional.pad(self.segments, (0, s - self.segments.size(1)), value=-1)
        pos = torch.nn.functional.pad(self.position_ids, (0, s - self.position_ids.size(1)))
        local = pos.index_select(1, positions(s, cp_size, cp_rank, pos.device))
        return TreeRowParams(qkv_format="sbhd", max_seqlen_q=s, max_seqlen_kv=s, segments=seg,
                             rotary_positions=local, cp_size=cp_size, cp_rank=cp_rank)

    def window(self, full: Tensor, window: Tensor) -> Tensor:
        """Gathered outputs [n, s, ...] -> [b, R, ...] at the micro-batch's window columns [b, R]."""
        n, s = full.shape[:2]
        cols = self.read_cols.gather(1, window)  # [b, R]
        idx = self.read_rows.unsqueeze(1) * s + cols
        flat = full.reshape(n * s, *full.shape[2:])
        return flat.index_select(0, idx.reshape(-1)).view(*idx.shape, *full.shape[2:])


class PlainRows:
    """A CP micro-batch's rows as they are (no sharing): the left-aligned rows, read at the window's columns."""

    def __init__(self, mb: ModelBatch):
        self.input_ids, self.position_ids = mb.left_aligned()  # [b, S] each

    def pad_to(self, rows: int, seq_len: int) -> "PlainRows":
        """Padded with whole padding rows and columns to [rows, seq_len] (equal shapes where megatron needs them)."""
        n, s = self.input_ids.shape
        pad = (0, seq_len - s, 0, rows - n)
        self.input_ids = torch.nn.functional.pad(self.input_ids, pad)
        self.position_ids = torch.nn.functional.pad(self.position_ids, pad)
        return self

    def params(self, split: Any, cp_size: int, cp_rank: int) -> None:
        return None

    def window(self, full: Tensor, window: Tensor) -> Tensor:
        """Gathered per-position results [b, s] -> [b, R] at the window's columns [b, R]."""
        return full.gather(1, window)


def tree_rows(mb: ModelBatch) -> TreeRows:
    """`mb`'s rows with each group of one prompt as one tree row (module doc)."""
    ids, _ = mb.left_aligned()  # [b, S]
    b, width = ids.shape
    plen = mb.prompt_lengths().to(torch.long).tolist()
    lengths = (mb.prompt_lengths().to(torch.long) + mb.response_lengths().to(torch.long)).tolist()
    rows: list[tuple[Tensor, Tensor, Tensor]] = []  # (ids, positions, segments) of each row
    read_rows, read_cols = [0] * b, [torch.arange(width)] * b
    for group in prompt_groups(mb):
        real = [i for i in group if lengths[i] > 0]
        if len(real) < 2:  # rows alone (padding rows included): as they are
            for i in group:
                n = lengths[i]
                read_rows[i] = len(rows)
                rows.append((ids[i].cpu(), _arange_then(n, width), -(torch.arange(width) >= n).long()))
            continue
        p = plen[real[0]]
        parts = [(ids[real[0], : p - 1].cpu(), torch.arange(p - 1), torch.zeros(p - 1, dtype=torch.long))]
        at = p - 1
        for k, i in enumerate(real, 1):
            branch = lengths[i] - (p - 1)  # the last prompt token, then the response
            parts.append((ids[i, p - 1: lengths[i]].cpu(), torch.arange(p - 1, lengths[i]), torch.full((branch,), k)))
            c = torch.arange(width).clamp(max=lengths[i] - 1)
            read_rows[i], read_cols[i] = len(rows), torch.where(c < p - 1, c, at + c - (p - 1))
            at += branch
        rows.append(tuple(torch.cat(x) for x in zip(*parts)))
    s = max(r[0].numel() for r in rows)
    dev = ids.device

    def stack(k: int, fill: int) -> Tensor:
        return torch.stack([torch.nn.functional.pad(r[k].long(), (0, s - r[k].numel()), value=fill)
                            for r in rows]).to(dev)

    return TreeRows(stack(0, 0), stack(1, 0), stack(2, -1), torch.tensor(read_rows, device=dev),
                    torch.stack(read_cols).to(dev))


def _arange_then(n: int, width: int) -> Tensor:
    """[width]: 0 .. n-1, then 0 (padding)."""
    return torch.cat([torch.arange(n), torch.zeros(width - n, dtype=torch.long)])
