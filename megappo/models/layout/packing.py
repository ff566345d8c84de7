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
from typing import Any, NamedTuple, Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from torch import Tensor

from megappo.models.batch import ModelBatch

__all__ = ["Pack", "pack_lengths", "pack_micro_batch", "unpack_window", "attend_packed"]


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

    def window(self, output: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        """`unpack_window` of this pack."""
        return unpack_window(output, self, window)


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


def attend_packed(attn: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                  packed_seq_params: Any) -> Tensor:
    """`SDPAttention` (`attn`) over a pack in megatron's THD format: query [t, np, hn], key/value [t, ng, hn] of
    sequences concatenated at `cu_seqlens` -> [t, np * hn]; attention within each sequence (causal or bidirectional
    by `attn_mask_type`), sequences of equal length batched into one SDPA call (no [t, t] mask)."""
    if getattr(packed_seq_params, "qkv_format", None) != "thd":
        raise NotImplementedError(f"SDPAttention packs the 'thd' format only, not "
                                  f"{getattr(packed_seq_params, 'qkv_format', None)!r}")
    if attention_mask is not None:
        raise ValueError("packed sequences take no attention_mask: each sequence attends to itself only")
    if attn.attn_mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
        raise NotImplementedError(f"packed SDPAttention is causal or no_mask (bidirectional) only, not "
                                  f"{attn.attn_mask_type}")
    causal = attn.attn_mask_type == AttnMaskType.causal
    cu_q, cu_kv = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv
    if getattr(packed_seq_params, "cu_seqlens_q_padded", None) is not None or (
            cu_kv is not None and cu_kv is not cu_q and not torch.equal(cu_q, cu_kv)):
        raise NotImplementedError("packed SDPAttention needs cu_seqlens_kv == cu_seqlens_q and no padded "
                                  "cu_seqlens (self attention, no context parallelism)")
    t, nq, hn = query.shape
    attn.check_heads(nq, key.size(1))
    plan = _pack_plan(packed_seq_params, cu_q, t, query.device, attn.group_equal_lengths)
    key, value, gqa = attn.grouped_heads(key, value, nq, query.device.type == "cpu"
                                         or query.dtype in (torch.float16, torch.bfloat16))

    def batch_of(x: Tensor, group: _PackGroup) -> Tensor:
        """The group's k sequences of x [t, h, d] as [k, h, L, d] (a strided view where they are adjacent)."""
        if group.index is None:
            x = x[group.start:group.start + group.count * group.length]
        else:
            x = x.index_select(0, group.index)
        return x.unflatten(0, (group.count, group.length)).transpose(1, 2)

    def attend(dropout_p: float) -> list[Tensor]:
        outs = []
        for g in plan.groups:
            out = F.scaled_dot_product_attention(
                batch_of(query, g), batch_of(key, g), batch_of(value, g), dropout_p=dropout_p,
                is_causal=causal and g.length > 1, scale=attn.softmax_scale, **gqa)  # [k, np, L, hn]
            outs.append(out.transpose(1, 2).reshape(g.count * g.length, nq * hn))
        return outs

    outs = attn.run_attention(attend)
    out = torch.cat(outs) if len(outs) > 1 else outs[0]  # [t, np * hn] in the groups' token order
    return out if plan.inverse is None else out.index_select(0, plan.inverse)


class _PackGroup(NamedTuple):
    """`count` sequences of `length` tokens: adjacent from token `start` (index None) or at the tokens `index`."""

    length: int
    count: int
    start: int
    index: Optional[Tensor]


class _PackPlan(NamedTuple):
    groups: list  # [_PackGroup]
    inverse: Optional[Tensor]  # the groups' token order -> pack order (None: already the pack order)


def _pack_plan(packed_seq_params: Any, cu_seqlens: Tensor, t: int, device: torch.device, group: bool) -> _PackPlan:
    """How `_forward_packed` batches the pack's sequences, built once per forward: every layer gets the same
    PackedSeqParams object, so the one device-to-host copy of cu_seqlens and the index tensors are cached on it."""
    key = (t, str(device), group)
    cached = getattr(packed_seq_params, "_megappo_plan", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    bounds = cu_seqlens.tolist()
    if not bounds or bounds[0] != 0 or bounds[-1] != t:
        raise ValueError(f"cu_seqlens {bounds[:1]}..{bounds[-1:]} do not cover the pack of {t} tokens")
    seqs = [(lo, hi - lo) for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]
    if group:
        by_length: dict[int, list[int]] = {}
        for lo, n in seqs:
            by_length.setdefault(n, []).append(lo)
        runs = list(by_length.items())
    else:
        runs = [(n, [lo]) for lo, n in seqs]
    groups, order = [], []
    for n, starts in runs:
        adjacent = all(b - a == n for a, b in zip(starts, starts[1:]))
        index = None if adjacent else torch.cat([torch.arange(lo, lo + n) for lo in starts]).to(device)
        groups.append(_PackGroup(n, len(starts), starts[0], index))
        order += starts
    inverse = None
    if order != sorted(order):  # the groups' outputs, concatenated, are not in pack order: undo the permutation
        perm = torch.cat([torch.arange(lo, lo + n) for n, starts in runs for lo in starts])
        inverse = torch.argsort(perm).to(device)
    plan = _PackPlan(groups, inverse)
    try:
        packed_seq_params._megappo_plan = (key, plan)
    except AttributeError:  # a slotted or frozen params object: no cache
        pass
    return plan
