"""Model (and optimizer) checkpoints through megatron's dist_checkpointing (torch_dist format).

Layout-independent: every tensor is saved under its global name and shape, so a checkpoint written at TP2xPP2 loads
at TP1 (or any layout whose padded vocabulary agrees). Atomic: all ranks write into `<dir>.tmp-<id>`; after a
barrier rank 0 writes `megappo_checkpoint.json` and renames the folder to `<dir>`, so `<dir>` either holds a
complete checkpoint or does not exist. Before loading, every file the torch_dist metadata references is checked to
exist with the recorded size, so a truncated copy fails naming the file, and every pickle in it is checked against an
allow-list (`megappo.models.safe_pickle`), so a checkpoint from elsewhere cannot run code when it is loaded.

Layout of the state dict: `{"model": ...}` (or `"model0"`, `"model1"`... one per virtual pipeline chunk), optional
`"optimizer"` (or, for an optimizer that never stepped, `"optimizer_fresh"`: see `megappo.models.optim_state`), and
plain Python `"scheduler_state"` / `"extra"` saved once by rank 0.

Saves go through `megappo.models.save_strategy`: megatron's writer with forked shard workers that die with the saving
process, and no multiprocessing manager (which would outlive a killed run).
"""
from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megappo.models.builder import unwrap
from megappo.models.checkpoint_errors import CheckpointError, SaveAbandoned
from megappo.models.optim_state import ensure_state, fresh_state, is_fresh, load_state, reset_to_fresh
from megappo.parallel import lost_peer, reduce_over_ranks, union_over_ranks

MARKER_FILE = "megappo_checkpoint.json"
FORMAT_VERSION = 1


def rank0_step(fn: Any, what: str) -> None:
    """Run `fn()` on rank 0 and let every rank know whether it worked: a failure raises CheckpointError on every
    rank (a barrier after a rank-0 write would leave the others waiting for a rank that raised). Collective."""
    error = None
    if _rank() == 0:
        try:
            fn()
        except Exception as e:  # disk full, quota, permissions
            error = e
    failed = reduce_over_ranks([0.0 if error is None else 1.0], dist.ReduceOp.MAX)[0] if dist.is_initialized() \
        else float(error is not None)
    if failed:
        cause = f"{type(error).__name__}: {error}" if error is not None else "see rank 0's error"
        raise CheckpointError(f"{what} failed on rank 0 ({cause})") from error


@dataclass
class LoadedCheckpoint:
    """What `load_model_checkpoint` returns besides the weights it loaded in place."""

    directory: str
    scheduler_state: Any = None
    extra: Any = None
    info: dict = field(default_factory=dict)  # megappo_checkpoint.json (layout at save, time, ...)
    missing_keys: list = field(default_factory=list)  # only when strict=False


def _metadata(dp_cp_group: Any) -> dict[str, Any]:
    md: dict[str, Any] = {
        # Optimizer state in the canonical per-parameter form, so it reshards across TP/PP/DP like the weights.
        "distrib_optim_sharding_type": "fully_reshardable",
        "chained_optim_avoid_prefix": True,
        "singleton_local_shards": False,
    }
    if dp_cp_group is not None:
        md["dp_cp_group"] = dp_cp_group
    return md


def _chunk_sharded_state_dict(chunk: nn.Module, metadata: dict) -> dict[str, Any]:
    """A chunk's sharded state dict, or of it the entries its `megappo_checkpoint_keys` keeps (a chunk that trains
    part of itself over a frozen base, which the Hugging Face checkpoint it was built from holds)."""
    m = unwrap(chunk)
    sd = m.sharded_state_dict(metadata=metadata)
    keep = getattr(m, "megappo_checkpoint_keys", None)
    return sd if keep is None else {k: v for k, v in sd.items() if keep(k)}


def _model_sharded_state_dict(model_chunks: list[nn.Module], metadata: dict) -> dict[str, Any]:
    if len(model_chunks) == 1:
        return {"model": _chunk_sharded_state_dict(model_chunks[0], metadata)}
    return {f"model{i}": _chunk_sharded_state_dict(m, metadata) for i, m in enumerate(model_chunks)}


def _check_shapes(state: dict, directory: str, info: dict, model_chunks: list[nn.Module]) -> None:
    """Raise CheckpointError naming each tensor whose global shape differs from the checkpoint's.

    torch's checkpoint reader would otherwise load a [1, H] value head from a [V, H] LM head without complaint.
    """
    from megatron.core.dist_checkpointing import load_tensors_metadata
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    saved = load_tensors_metadata(directory)
    bad = []
    for sh in nested_values(state):
        if isinstance(sh, ShardedTensor) and sh.key in saved:
            want = tuple(saved[sh.key].global_shape)
            if tuple(sh.global_shape) != want:
                bad.append(f"{sh.key}: checkpoint {want}, model {tuple(sh.global_shape)}")
    if bad:
        here = _describe_chunks(model_chunks)
        raise CheckpointError(
            f"{directory} ({info.get('family')} {info.get('role')}, padded vocab {info.get('padded_vocab_size')}) does "
            f"not fit this {here.get('family')} {here.get('role')} (padded vocab {here.get('padded_vocab_size')}): "
            + "; ".join(sorted(set(bad))[:6])
        )


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _agree_on_tmp_dir(directory: str) -> str:
    token = [f"{uuid.uuid4().hex[:8]}"]
    if dist.is_initialized():
        dist.broadcast_object_list(token, src=0)
    return f"{directory}.tmp-{token[0]}"


def _describe_chunks(model_chunks: list[nn.Module]) -> dict[str, Any]:
    m = unwrap(model_chunks[0])
    cfg, spec = getattr(m, "megappo_config", None), getattr(m, "megappo_spec", None)
    info: dict[str, Any] = {"role": getattr(m, "megappo_role", None), "num_chunks": len(model_chunks)}
    if cfg is not None:
        info["layout"] = dict(
            tp=cfg.tensor_model_parallel_size, pp=cfg.pipeline_model_parallel_size,
            vpp=cfg.virtual_pipeline_model_parallel_size, cp=cfg.context_parallel_size,
            ep=cfg.expert_model_parallel_size, etp=cfg.expert_tensor_parallel_size,
        )
    if spec is not None:
        info.update(family=spec.family, vocab_size=spec.vocab_size, padded_vocab_size=spec.padded_vocab_size)
    return info


def save_model_checkpoint(
    model_chunks: list[nn.Module],
    directory: str,
    *,
    optimizer: Any = None,
    scheduler_state: Any = None,
    extra: Any = None,
    dp_cp_group: Any = None,
    overwrite: bool = True,
) -> str:
    """Save this rank's chunks (and `optimizer`'s state) into `directory`; collective over all ranks.

    `scheduler_state`/`extra` are picklable Python objects (saved once). `dp_cp_group` is the data x context
    parallel group (defaults to megatron's). An existing `directory` is replaced only after the new checkpoint is
    complete (`overwrite=False` raises instead). Returns the directory.
    """
    from megatron.core import dist_checkpointing

    directory = os.path.abspath(directory)
    if os.path.exists(directory) and not overwrite:
        raise CheckpointError(f"{directory} exists; pass overwrite=True or choose another directory")
    tmp = _agree_on_tmp_dir(directory)
    rank0_step(lambda: os.makedirs(tmp, exist_ok=False), f"creating {tmp}")
    metadata = _metadata(dp_cp_group)
    state = _model_sharded_state_dict(model_chunks, metadata)
    fresh = optimizer is not None and is_fresh(optimizer)  # never stepped: nothing megatron could load back
    if fresh:
        state["optimizer_fresh"] = fresh_state(optimizer)
    elif optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(dict(state), is_loading=False, metadata=metadata)
    state["scheduler_state"] = scheduler_state
    state["extra"] = extra
    try:
        from megappo.models.save_strategy import save_strategy  # no helper process outlives the run
        dist_checkpointing.save(state, tmp, sharded_strategy=save_strategy(),
                                content_metadata={"megappo_format": FORMAT_VERSION})
    except Exception as e:
        # torch's CheckpointException (a BaseException, not caught here) is the shard writes' failure, agreed by
        # every rank. Anything else came from one rank's own step (rank 0 alone writes common.pt and
        # metadata.json), and the other ranks now wait for this one in the save's next collective.
        if dist.is_initialized() and dist.get_world_size() > 1:
            if lost_peer(e):
                raise SaveAbandoned(f"another rank stopped while this one waited for it in the save of {tmp}; "
                                    "that rank's error says why") from e
            raise SaveAbandoned(f"saving {tmp} failed on rank {_rank()} ({type(e).__name__}: {e}) while the other "
                                "ranks wait for it inside the save") from e
        raise
    _barrier()

    def publish() -> None:
        write_marker(tmp, model_chunks, has_optimizer=optimizer is not None, optimizer_fresh=fresh)
        old = None
        if os.path.exists(directory):
            old = f"{tmp}.old"
            os.rename(directory, old)
        os.rename(tmp, directory)
        if old:
            shutil.rmtree(old, ignore_errors=True)

    rank0_step(publish, f"publishing {tmp} as {directory}")
    return directory


def write_marker(directory: str, model_chunks: list[nn.Module], *, has_optimizer: bool,
                 optimizer_fresh: bool = False) -> None:
    """Write `megappo_checkpoint.json` (role, layout at save, family, vocab) into a just-saved checkpoint.
    `optimizer_fresh`: the optimizer had never stepped, and the checkpoint holds no state of it to load."""
    info = dict(_describe_chunks(model_chunks), format=FORMAT_VERSION, saved_at=time.time(),
                world_size=dist.get_world_size() if dist.is_initialized() else 1, has_optimizer=has_optimizer)
    if has_optimizer:
        info["optimizer_state"] = "fresh" if optimizer_fresh else "saved"
    with open(os.path.join(directory, MARKER_FILE), "w") as f:
        json.dump(info, f, indent=1)


def model_sharded_state_dict(model_chunks: list[nn.Module], dp_cp_group: Any = None) -> dict[str, Any]:
    """The state dict `save_model_checkpoint` saves for the weights alone (no optimizer), with its common keys."""
    state = _model_sharded_state_dict(model_chunks, _metadata(dp_cp_group))
    state["scheduler_state"] = None
    state["extra"] = None
    return state


def _missing(path: str) -> CheckpointError:
    return CheckpointError(f"{path} is missing: the checkpoint is incomplete")


def verify_checkpoint(directory: str) -> dict[str, Any]:
    """Check `directory` is a complete megappo checkpoint that holds no foreign code; return its info.

    Raises CheckpointError naming the missing or truncated file, or a pickle (`.metadata`, `common.pt`, an object
    in a `.distcp` file) that references anything but checkpoint metadata, tensors and plain containers: every load
    goes through here before torch or megatron unpickle those files (see `megappo.models.safe_pickle`)."""
    directory = os.path.abspath(directory)
    if not os.path.isdir(directory):
        parent, name = os.path.dirname(directory), os.path.basename(directory)
        tmp_dirs = [d for d in os.listdir(parent) if d.startswith(name + ".tmp-")] if os.path.isdir(parent) else []
        hint = f" (found unfinished {tmp_dirs}: a save was interrupted)" if tmp_dirs else ""
        raise CheckpointError(f"checkpoint directory {directory} does not exist{hint}")
    marker = os.path.join(directory, MARKER_FILE)
    if not os.path.isfile(marker):
        raise CheckpointError(f"{marker} is missing: {directory} is not a complete megappo checkpoint")
    with open(marker) as f:
        try:
            info = json.load(f)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{marker} is corrupt ({e})") from e
    if not isinstance(info, dict):
        raise CheckpointError(f"{marker} is corrupt (a JSON {type(info).__name__}, not an object)")
    for required in ("metadata.json", ".metadata", "common.pt"):
        if not os.path.isfile(os.path.join(directory, required)):
            raise _missing(os.path.join(directory, required))
    meta = _read_metadata_safely(directory)
    needed: dict[str, int] = {}
    for storage in (meta.storage_data or {}).values():
        end = storage.offset + storage.length
        needed[storage.relative_path] = max(needed.get(storage.relative_path, 0), end)
    for rel, end in sorted(needed.items()):
        path = os.path.join(directory, rel)
        if os.path.isabs(rel) or os.path.normpath(rel).startswith(".."):
            raise CheckpointError(f"{os.path.join(directory, '.metadata')} points outside the checkpoint ({rel!r}); "
                                  f"refusing to read it")
        if not os.path.isfile(path):
            raise _missing(path)
        size = os.path.getsize(path)
        if size < end:
            raise CheckpointError(f"{path} is truncated: {size} bytes, the metadata needs {end}")
    _check_pickled_objects(directory, meta)
    return info


def _refused(path: str, why: Exception) -> CheckpointError:
    return CheckpointError(
        f"{path}: refused to load: {why}. megappo unpickles only torch checkpoint metadata, tensors and plain "
        f"containers, so a file that names other code was not written by megappo/megatron (or was altered); "
        f"re-create the checkpoint from a trusted source"
    )


def _read_metadata_safely(directory: str) -> Any:
    """The torch_dist `.metadata` read through the allow-list unpickler, before torch or megatron unpickle it."""
    from megappo.models.safe_pickle import UnsafePickleError, load_dcp_metadata

    path = os.path.join(directory, ".metadata")
    try:
        return load_dcp_metadata(path)
    except UnsafePickleError as e:
        raise _refused(path, e) from None
    except OSError as e:
        raise CheckpointError(f"{path} is unreadable ({e})") from e


def _check_pickled_objects(directory: str, meta: Any) -> None:
    """`common.pt` and every byte item in the `.distcp` files (ShardedObjects, which torch's load planner reads with
    `weights_only=False`) must load with torch's weights-only allow-list."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from megappo.models.safe_pickle import UnsafePickleError, check_torch_pickle

    common = os.path.join(directory, "common.pt")
    try:
        check_torch_pickle(common)
    except UnsafePickleError as e:
        raise _refused(common, e) from None
    byte_keys = {k for k, v in meta.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    for index, storage in (meta.storage_data or {}).items():
        if index.fqn not in byte_keys:
            continue
        path = os.path.join(directory, storage.relative_path)
        if getattr(storage, "transform_descriptors", None):
            raise _refused(path, ValueError(f"object {index.fqn!r} is stored transformed "
                                            f"({storage.transform_descriptors}), which megappo never writes"))
        with open(path, "rb") as f:
            f.seek(storage.offset)
            data = f.read(storage.length)
        try:
            check_torch_pickle(data)
        except UnsafePickleError as e:
            raise _refused(f"{path} (object {index.fqn!r})", e) from None


def load_model_checkpoint(
    model_chunks: list[nn.Module],
    directory: str,
    *,
    optimizer: Any = None,
    strict: bool = True,
    dp_cp_group: Any = None,
) -> LoadedCheckpoint:
    """Load weights (and `optimizer` state) saved by `save_model_checkpoint`, at any compatible layout.

    With strict=True a tensor the model needs but the checkpoint lacks raises CheckpointError naming it; with
    strict=False such tensors keep their current values and are listed in `missing_keys`. Collective.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    directory = os.path.abspath(directory)
    info = verify_checkpoint(directory)
    if optimizer is not None and not info.get("has_optimizer", False):
        raise CheckpointError(f"{directory} has no optimizer state; load with optimizer=None")
    metadata = _metadata(dp_cp_group)
    state = _model_sharded_state_dict(model_chunks, metadata)
    fresh = optimizer is not None and info.get("optimizer_state") == "fresh"
    if optimizer is not None and not fresh:
        ensure_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(dict(state), is_loading=True, metadata=metadata)
    _check_shapes(state, directory, info, model_chunks)
    try:
        # megatron names them the other way round from torch: its "missing" keys are in the checkpoint but not
        # requested (optimizer state when loading weights alone: fine), its "unexpected" keys are requested but
        # absent from the checkpoint (what strict loading must refuse)
        loaded, _ckpt_only, absent = dist_checkpointing.load(state, directory, strict=StrictHandling.RETURN_ALL)
    except Exception as e:  # noqa: BLE001 - re-raised with the directory and the layouts involved
        raise CheckpointError(
            f"loading {directory} (saved with {info.get('layout')}, padded vocab {info.get('padded_vocab_size')}) "
            f"into {_describe_chunks(model_chunks).get('layout')} failed: {e}"
        ) from e
    missing = sorted(union_over_ranks(absent))  # each rank sees only the keys it requested
    if missing and strict:
        raise CheckpointError(
            f"{directory} lacks {len(missing)} tensors this model needs, e.g. {missing[:5]}; check the role/family "
            "or load with strict=False"
        )
    for i, chunk in enumerate(model_chunks):
        key = "model" if len(model_chunks) == 1 else f"model{i}"
        partial = getattr(unwrap(chunk), "megappo_checkpoint_keys", None) is not None  # a part: the rest stays
        unwrap(chunk).load_state_dict(loaded[key], strict=not missing and not partial)
    if fresh:
        reset_to_fresh(optimizer, loaded.get("optimizer_fresh"))
    elif optimizer is not None:
        load_state(optimizer, loaded["optimizer"])
    return LoadedCheckpoint(directory, loaded.get("scheduler_state"), loaded.get("extra"), info, missing)
