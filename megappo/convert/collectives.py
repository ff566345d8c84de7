"""The collectives of a megatron -> Hugging Face export, shared by every model kind: which pipeline stage owns each
parameter, broadcasting its shard from there, all-gathering TP shards, cutting the merged tensors into buckets, and
a last pipeline stage's output brought to every rank (verify)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

import torch
import torch.distributed as dist

Bucket = list[tuple[str, torch.Tensor]]  # (hf_name, full tensor) pairs


@dataclass
class Meta:
    shape: tuple[int, ...]  # this rank's shard shape (same on the owner's TP/EP peers)
    dtype: torch.dtype


def group_size(group: Any) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def gather_owners(mine: dict[str, Meta], group: Any) -> dict[str, tuple[int, Meta]]:
    """canonical name -> (group rank of the pipeline stage holding it, metadata), agreed by every rank."""
    if group_size(group) == 1:
        return {n: (0, m) for n, m in mine.items()}
    gathered: list[Any] = [None] * group_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    owners: dict[str, tuple[int, Meta]] = {}
    for r, metas in enumerate(gathered):
        for n, m in metas.items():
            owners.setdefault(n, (r, m))  # tied embedding copies: the first stage's wins
    return owners


def broadcast_from(t: Optional[torch.Tensor], meta: Meta, src: int, group: Any, device: torch.device) -> torch.Tensor:
    """Broadcast `t` from group rank `src`; other ranks pass None and get a new tensor of `meta`."""
    if group_size(group) == 1:
        return t
    if t is None:
        t = torch.empty(meta.shape, dtype=meta.dtype, device=device)
    dist.broadcast(t, src=dist.get_global_rank(group, src), group=group)
    return t


def all_gather(t: torch.Tensor, group: Any) -> list[torch.Tensor]:
    n = group_size(group)
    if n == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def hf_tensors(pairs, shards: list[torch.Tensor], dtype: Optional[torch.dtype], copy: bool) -> Bucket:
    """One parameter's merged HF tensors in `dtype`; with `copy`, never a view of a shard (a kept tensor must not
    change with the parameter it came from)."""
    out: Bucket = []
    for name, full in pairs:
        full = full.to(dtype) if dtype is not None else full
        if copy and any(same_storage(full, s) for s in shards):
            full = full.clone()
        out.append((name, full))
    return out


def bucketed(groups: Iterable[Bucket], bucket_bytes: int) -> Iterator[Bucket]:
    """Buckets of about `bucket_bytes` from groups (one parameter's HF tensors, never split across buckets), lazily:
    each group is produced (collectively) only when the consumer asks for the next bucket."""
    bucket: Bucket = []
    nbytes = 0
    for group in groups:
        bucket.extend(group)
        nbytes += sum(t.numel() * t.element_size() for _, t in group)
        if nbytes >= bucket_bytes:
            yield bucket
            bucket, nbytes = [], 0
    if bucket:
        yield bucket


def last_stage_output(out: Optional[torch.Tensor], ps: Any, is_value: bool, vocab_size: Optional[int],
                      device: torch.device) -> torch.Tensor:
    """The last pipeline stage's output (`out`, None elsewhere) on every rank, on the CPU: an LM's vocab-parallel
    logits gathered over `tp_group` and cut to `vocab_size`, broadcast over `pp_group`. Collective."""
    if out is not None and not is_value:
        if ps.tp_size > 1:
            parts = [torch.empty_like(out) for _ in range(ps.tp_size)]
            dist.all_gather(parts, out.contiguous(), group=ps.tp_group)
            out = torch.cat(parts, dim=-1)
        out = (out[..., :vocab_size] if vocab_size else out).contiguous()  # gloo sends raw storage
    if ps.pp_size > 1:
        shape = [tuple(out.shape) if ps.is_pipeline_last_stage else None]
        last = dist.get_global_rank(ps.pp_group, ps.pp_size - 1)
        dist.broadcast_object_list(shape, src=last, group=ps.pp_group)
        if out is None:
            out = torch.empty(shape[0], dtype=torch.float32, device=device)
        dist.broadcast(out, src=last, group=ps.pp_group)
    return out.cpu()
