"""Sequence packing (verl's `use_remove_padding`): a micro-batch's sequences concatenated without padding.

A `ModelBatch` micro-batch holds b rows [left padding | prompt | response | right padding]. Packed, its real tokens
become one row of T = sum(L_i) tokens (L_i = row i's prompt + response tokens), in megatron-core's THD layout: the
model runs on input_ids [1, T] with a `PackedSeqParams` whose `cu_seqlens` [b + 1] (int32) mark where each sequence
starts, so that

- attention is causal within each sequence and never crosses one (transformer-engine / flash-attention varlen
  kernels on GPU; `SDPAttention` runs one SDPA call per sequence on the local spec, no dense [T, T] mask);
- rotary positions restart at 0 for every sequence (megatron's `apply_rotary_pos_emb` with `cu_seqlens`), and the
  position ids passed (learned absolute embeddings) are each sequence's own, 0..L_i-1.

Every other layer (norms, MLPs, MoE routing, the output layer or value head) is per token, so a sequence's outputs
are those of its padded row up to floating-point summation order: log-probs, entropy, values and gradients agree
with the padded path to ~1e-6 in float32 (tests/multirank/test_packing_exact.py).

A pack can be padded at its tail (`pack_len`) to a given length: the padding is one extra sequence of pad tokens
(attending only to itself, masked out of every loss). That gives a multiple of the TP size under sequence
parallelism and equal pack lengths where megatron needs equal shapes (virtual pipeline stages, the allgather MoE
token dispatcher across expert-parallel ranks).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from megappo.models.batch import ModelBatch

__all__ = ["Pack", "pack_lengths", "pack_micro_batch", "unpack_window"]


def pack_lengths(mb: ModelBatch) -> torch.Tensor:
    """[b] real tokens per row: prompt + response (up to the last real response token); 0 for padding rows."""
    return mb.prompt_lengths().to(torch.long) + mb.response_lengths().to(torch.long)


@dataclass
class Pack:
    """One packed micro-batch: the model's inputs and where each row's tokens sit in the pack."""

    input_ids: torch.Tensor  # [1, T] long
    position_ids: torch.Tensor  # [1, T] long, 0..L_i-1 per sequence (0 on the tail padding)
    cu_seqlens: torch.Tensor  # [n + 1] int32: the sequences (rows with L_i > 0, then the tail padding if any)
    max_seqlen: int
    starts: torch.Tensor  # [b] long: row i's first token in the pack
    lengths: torch.Tensor  # [b] long: L_i

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def packed_seq_params(self) -> Any:
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                               max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen)


def pack_micro_batch(mb: ModelBatch, pack_len: Optional[int] = None, multiple: int = 1,
                     pad_token_id: int = 0) -> Pack:
    """Pack `mb`'s rows (see the module doc). `pack_len`: pad the pack's tail to at least this many tokens;
    `multiple`: and to a multiple of this (the TP size under sequence parallelism)."""
    lengths = pack_lengths(mb)  # [b]
    ids, pos = mb.left_aligned()  # real tokens of row i in columns 0..L_i-1
    keep = torch.arange(mb.seq_len, device=ids.device).unsqueeze(0) < lengths.unsqueeze(1)  # [b, s]
    flat_ids, flat_pos = ids[keep], pos[keep]  # row-major: the rows one after another
    total = int(lengths.sum())
    target = max(total, pack_len or 0, 1)
    target = -(-target // multiple) * multiple
    seqs = [int(n) for n in lengths.tolist() if n > 0]
    if target > total:
        tail = target - total
        flat_ids = torch.cat([flat_ids, flat_ids.new_full((tail,), pad_token_id)])
        flat_pos = torch.cat([flat_pos, flat_pos.new_zeros(tail)])
        seqs.append(tail)
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(seqs, dtype=torch.int32).cumsum(0)
    starts = torch.cumsum(lengths, 0) - lengths
    return Pack(flat_ids.unsqueeze(0), flat_pos.unsqueeze(0), cu.to(ids.device), max(seqs), starts, lengths)


def unpack_window(output: torch.Tensor, pack: Pack, window: torch.Tensor) -> torch.Tensor:
    """Per-row columns of a packed output: output [1, T, ...], window [b, R] (columns of the left-aligned rows)
    -> [b, R, ...]. Columns past a row's last token (padding, masked out downstream) read that last token."""
    last = (pack.lengths - 1).clamp(min=0).unsqueeze(1)  # [b, 1]
    idx = (pack.starts.unsqueeze(1) + torch.minimum(window, last)).clamp_(0, pack.num_tokens - 1)  # [b, R]
    flat = output[0]  # [T, ...]
    return flat.index_select(0, idx.reshape(-1)).view(*idx.shape, *flat.shape[1:])
