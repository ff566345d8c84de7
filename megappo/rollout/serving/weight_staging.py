"""Staging buffers that outlive a weight sync: what the SGLang sync modes copy each exported bucket into.

`tensor` mode (`SharedStaging`): a server on the same machine maps the trainer's memory by handle. Sharing each
exported tensor (`share_memory_()`) made a new /dev/shm file per tensor per sync, faulted its pages in and copied
the tensor into it; most of the sync went there. Here each slot is one shared-memory buffer, allocated at the first
sync (grown when a later bucket is larger) and reused by every later one: a bucket costs one copy into it on this
side and one copy out of it into the parameters on the server's. Two slots let the trainer fill one while a server
copies out of the other.

`distributed` mode (`flat_bucket`): a bucket goes as one broadcast of one flat byte buffer (SGLang's
`load_format="flattened_bucket"`) instead of one broadcast per tensor: fewer, larger messages over the weight group.
"""
from __future__ import annotations

import io
from typing import Optional

import torch

Bucket = list[tuple[str, torch.Tensor]]
_ALIGN = 64  # bytes: each staged tensor starts on a cache line


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class SharedStaging:
    """`slots` shared-memory (file_system strategy) byte buffers, reused across syncs.

    `stage(slot, bucket)` copies the bucket into slot `slot` and returns (name, view) pairs whose storage is that
    buffer; `handles(staged)` pickles them as torch's shared-memory handles (bytes, no tensor data). The caller must
    not stage into a slot again before every receiver of its handles has copied out of it. Memory: `slots` times
    the largest bucket, held until `close()`.
    """

    def __init__(self, slots: int = 2):
        self.buffers: list[Optional[torch.Tensor]] = [None] * slots

    def stage(self, slot: int, bucket: Bucket) -> Bucket:
        offsets, end = [], 0
        for _, t in bucket:
            start = -(-end // _ALIGN) * _ALIGN
            offsets.append(start)
            end = start + _nbytes(t)
        buf = self.buffers[slot]
        if buf is None or buf.numel() < end:
            import torch.multiprocessing

            # the HTTP path has no socket to pass file descriptors: receivers open the buffer by file name
            torch.multiprocessing.set_sharing_strategy("file_system")
            self.buffers[slot] = None  # free the old buffer before allocating the larger one
            buf = self.buffers[slot] = torch.empty(max(end, 1), dtype=torch.uint8).share_memory_()
        staged = []
        for (name, t), start in zip(bucket, offsets):
            view = buf[start:start + _nbytes(t)].view(t.dtype).view(t.shape)
            view.copy_(t)
            staged.append((name, view))
        return staged

    @staticmethod
    def handles(staged: Bucket) -> bytes:
        """One receiver's payload: torch counts a reference per pickled handle and drops it when the receiver
        unpickles, so a payload must be unpickled exactly once (one per server TP rank, never shared)."""
        from multiprocessing.reduction import ForkingPickler

        buf = io.BytesIO()
        ForkingPickler(buf).dump(staged)
        return buf.getvalue()

    def close(self) -> None:
        self.buffers = [None] * len(self.buffers)


def flat_bucket(bucket: Bucket, staging: list) -> Optional[torch.Tensor]:
    """The bucket's tensors packed back to back (SGLang's FlattenedTensorBucket layout: byte offsets without
    padding, each a multiple of its dtype's size) in a byte buffer kept in `staging[0]` across calls; a single
    contiguous tensor is sent as it is. None when the layout would misalign a tensor (mixed dtypes): the caller
    then broadcasts tensor by tensor."""
    if not bucket:
        return None
    end = 0
    for _, t in bucket:
        if end % t.element_size():
            return None
        end += _nbytes(t)
    if len(bucket) == 1 and bucket[0][1].is_contiguous():
        return bucket[0][1].reshape(-1).view(torch.uint8)
    device = bucket[0][1].device
    buf = staging[0] if staging else None
    if buf is None or buf.numel() < end or buf.device != device:
        staging[:] = [None]
        buf = staging[0] = torch.empty(end, dtype=torch.uint8, device=device)
    flat, start = buf[:end], 0
    for _, t in bucket:
        n = _nbytes(t)
        flat[start:start + n].view(t.dtype).view(t.shape).copy_(t)
        start += n
    return flat
