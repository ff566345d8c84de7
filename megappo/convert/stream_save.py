"""Write a megatron dist_checkpoint bucket by bucket from a model built on the meta device.

Saving a built model holds all of it in memory, and megatron's torch_dist writer stages a second copy of what it
writes. Here the model is built on the meta device instead (no storage), and its `sharded_state_dict()` still
describes every tensor of the checkpoint: key, global shape, offset, replica. The tensors are then produced a bucket
at a time by a callback (e.g. sliced out of Hugging Face safetensors), saved with megatron's own
`dist_checkpointing.save` into a sub-folder, and released, so peak memory is about one bucket plus the largest
tensor (measured: a 763 MB model with 32/160/320 MB buckets peaked at 653/780/743 MB).

The buckets' torch_dist metadata are merged into one `.metadata` whose entries point at the buckets' data files,
renamed next to it: the result holds the same keys, global shapes and chunks as one save of the whole model would,
and loads through `megappo.models.checkpoint.load_model_checkpoint` at any layout.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, create_default_global_save_plan
from torch.distributed.checkpoint.planner import SavePlan

from megappo.convert.mapping import ConversionError
from megappo.parallel import reduce_over_ranks

Path = tuple  # the keys leading to an item in the nested sharded state dict


def _flatten(d: dict, prefix: Path = ()) -> Iterator[tuple[Path, Any]]:
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flatten(v, prefix + (k,))
        else:
            yield prefix + (k,), v


def _nest(items: list[tuple[Path, Any]]) -> dict:
    out: dict = {}
    for path, v in items:
        d = out
        for k in path[:-1]:
            d = d.setdefault(k, {})
        d[path[-1]] = v
    return out


def _tensor_data(item: Any) -> Optional[torch.Tensor]:
    """The local tensor behind a ShardedTensor / ShardedTensorFactory (None for objects and plain values)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(item, (ShardedTensor, ShardedTensorFactory)) and torch.is_tensor(item.data):
        return item.data
    return None


def plan_buckets(items: list[tuple[Path, Any]], bucket_bytes: int) -> list[list[tuple[Path, Any]]]:
    """Consecutive `items` (all with tensor data) in buckets of about `bucket_bytes`."""
    buckets: list[list[tuple[Path, Any]]] = []
    size = bucket_bytes
    for path, item in items:
        t = _tensor_data(item)
        n = t.numel() * t.element_size()
        if size + n > bucket_bytes and size:
            buckets.append([])
            size = 0
        buckets[-1].append((path, item))
        size += n
    return buckets


def _materialised(item: Any, materialise: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    t = _tensor_data(item)
    real = materialise(t)
    if real is t:
        return item
    if real.device.type == "meta" or tuple(real.shape) != tuple(t.shape):
        raise ConversionError(f"{item.key}: produced {tuple(real.shape)} on {real.device}, the model needs "
                              f"{tuple(t.shape)}")
    return dataclasses.replace(item, data=real.to(t.dtype))


def _write_items(items: list[tuple[Path, Any]]) -> dict[Any, tuple[Any, torch.Tensor]]:
    """{MetadataIndex: (WriteItem, tensor)} for the main replicas of `items`, as megatron's torch_dist names them:
    the ShardedTensor's key, its global shape, one chunk at its global offset (prepended axes included)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories, is_main_replica
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    built = {str(i): item for i, (_, item) in enumerate(items)}
    apply_factories(built)  # e.g. the gated fc1 becomes its gate and up halves, each at its own offset
    out = {}
    for sh in nested_values(built):
        if not isinstance(sh, ShardedTensor) or not is_main_replica(sh.replica_id):
            continue  # another rank writes the main replica
        if sh.flattened_range is not None:
            raise ConversionError(f"{sh.key}: flattened (distributed-optimizer) shards are not model weights")
        data = sh.data.reshape((1,) * sh.prepend_axis_num + tuple(sh.local_shape))
        offsets = torch.Size(sh.global_offset)
        index = MetadataIndex(sh.key, offsets)
        write = WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=data.shape),
            properties=TensorProperties.create_from_tensor(data), size=torch.Size(sh.global_shape)))
        out[index] = (write, data)
    return out


class _BucketPlanner(DefaultSavePlanner):
    """A DCP save planner that writes exactly `writes`, whose chunks cover only part of each global tensor (the
    other buckets hold the rest, so the coverage check of the default planner is skipped)."""

    def __init__(self, writes: dict[Any, tuple[Any, torch.Tensor]]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.writes = writes

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan([w for w, _ in self.writes.values()])
        return self.plan

    def create_global_plan(self, all_plans):
        self.global_plan, self.metadata = create_default_global_save_plan(all_plans)
        return self.global_plan, self.metadata

    def resolve_data(self, write_item):
        return self.writes[write_item.index][1]


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _agree(n: int) -> int:
    """The maximum of `n` over all ranks."""
    return int(reduce_over_ranks([n], dist.ReduceOp.MAX, dtype=torch.int64)[0])


def save_streamed(state: dict, directory: str, materialise: Callable[[torch.Tensor], torch.Tensor], *,
                  bucket_bytes: int = 512 << 20, content_metadata: Optional[dict] = None,
                  progress: Optional[Callable[[int], None]] = None) -> dict[str, int]:
    """Save the sharded state dict `state` (weights on the meta device) into the empty folder `directory`.

    materialise(meta_tensor) -> the real tensor of that shape (or the tensor itself when it is real already); called
    once per local tensor, a bucket at a time, each bucket released once written. Objects and common state go
    through megatron's own `dist_checkpointing.save` first. Collective over all ranks (each writes its own main
    replicas; the bucket count is agreed). progress(n): n tensors were written. Returns this rank's
    {"buckets", "tensors", "bytes"}.
    """
    import torch.distributed.checkpoint as dcp
    from megatron.core import dist_checkpointing

    from megappo.models.save_strategy import save_strategy  # no helper process outlives the conversion

    rank, world = _world()
    items = list(_flatten(state))
    tensors = [(p, v) for p, v in items if _tensor_data(v) is not None]
    buckets = plan_buckets(tensors, bucket_bytes)
    n_buckets = _agree(len(buckets))
    buckets += [[] for _ in range(n_buckets - len(buckets))]
    subs = [os.path.join(directory, f"part{k:05d}") for k in range(n_buckets + 1)]
    if rank == 0:
        for sub in subs:
            os.makedirs(sub)
    if world > 1:
        dist.barrier()
    dist_checkpointing.save(_nest([(p, v) for p, v in items if _tensor_data(v) is None]), subs[0],
                            sharded_strategy=save_strategy(), content_metadata=content_metadata)
    n_tensors = n_bytes = 0
    for bucket, sub in zip(buckets, subs[1:]):
        writes = _write_items([(p, _materialised(v, materialise)) for p, v in bucket])
        writer = dcp.FileSystemWriter(sub, single_file_per_rank=True, thread_count=1, sync_files=True)
        dcp.save({}, storage_writer=writer, planner=_BucketPlanner(writes), no_dist=not dist.is_initialized())
        n_tensors += len(bucket)
        n_bytes += sum(t.numel() * t.element_size() for _, t in writes.values())
        if progress is not None:
            progress(len(bucket))
        # Whatever still holds the planner after the save must not hold the bucket's tensors: release them now
        # (measured: a planner kept alive by a reference cycle made memory grow by one bucket per bucket).
        writes.clear()
    if world > 1:
        dist.barrier()
    if rank == 0:
        merge_bucket_checkpoints(directory, subs)
    if world > 1:
        dist.barrier()
    return {"buckets": n_buckets, "tensors": n_tensors, "bytes": n_bytes}


def merge_bucket_checkpoints(directory: str, bucket_dirs: list[str]) -> None:
    """Merge torch_dist checkpoints that each hold part of one state dict into `directory`, removing them.

    Data files move up under a bucket prefix; `.metadata` entries are re-pointed and their chunks concatenated;
    megatron's `metadata.json` and `common.pt` come from the first bucket (the only one with common state).
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megappo.models.safe_pickle import load_dcp_metadata

    merged = None
    for k, sub in enumerate(bucket_dirs):
        md = load_dcp_metadata(os.path.join(sub, ".metadata"))
        prefix = f"b{k:05d}"
        for name in os.listdir(sub):
            if name.endswith(".distcp"):
                os.rename(os.path.join(sub, name), os.path.join(directory, prefix + name))
        storage = {idx: dataclasses.replace(info, relative_path=prefix + info.relative_path)
                   for idx, info in md.storage_data.items()}
        if merged is None:
            merged = md
            merged.storage_data = storage
            for name in ("metadata.json", "common.pt"):
                if os.path.exists(os.path.join(sub, name)):
                    os.rename(os.path.join(sub, name), os.path.join(directory, name))
        else:
            merged.storage_data.update(storage)
            for key, entry in md.state_dict_metadata.items():
                have = merged.state_dict_metadata.get(key)
                if have is None:
                    merged.state_dict_metadata[key] = entry
                elif isinstance(have, TensorStorageMetadata) and isinstance(entry, TensorStorageMetadata):
                    if tuple(have.size) != tuple(entry.size):
                        raise ConversionError(f"{key}: buckets disagree on its global shape ({tuple(have.size)} vs "
                                              f"{tuple(entry.size)})")
                    have.chunks.extend(entry.chunks)
                else:
                    raise ConversionError(f"{key}: stored twice by the bucketed save")
        shutil.rmtree(sub)
    if merged is None:
        raise ConversionError(f"{directory}: nothing was saved")
    if merged.storage_meta is not None:
        merged.storage_meta.checkpoint_id = directory
    tmp = os.path.join(directory, ".metadata.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(merged, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, os.path.join(directory, ".metadata"))
