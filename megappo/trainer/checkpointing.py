"""Trainer checkpoints, resume, and the final Hugging Face export of the actor.

Layout: `<default_local_dir>/checkpoints/global_step_<N>/` holds `actor/` and `critic/` (megatron dist_checkpoints
with optimizer and LR-scheduler state), `rng/rank_<r>.pt` (torch, numpy, python and megatron's model-parallel RNG
states of each rank) and `trainer_state.json` (step, data position, KL controller, guard, rollout weight version).

Atomic: everything is written into `global_step_<N>.tmp-<id>/`, fsynced, and renamed to `global_step_<N>` once every
rank has written its part; only then does `latest_checkpointed_iteration.txt` name it. A run killed while saving
leaves a `.tmp-` directory, which the next start removes; a save that fails (disk full) raises a CheckpointError
naming the directory and leaves the previous checkpoint as it was.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import sys
import uuid
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megappo.convert.mcore_to_hf import output_config, write_hf_dir
from megappo.kinds.weights import iter_hf_weights
from megappo.models.checkpoint import (CheckpointError, SaveAbandoned, load_model_checkpoint, rank0_step,
                                      save_model_checkpoint)
from megappo.parallel import leave_run, reduce_over_ranks
from megappo.trainer.files import fsync_dir, fsync_tree, write_atomic

TRACKER = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.json"
PREFIX = "global_step_"


def checkpoint_root(local_dir: str) -> str:
    return os.path.join(local_dir, "checkpoints")


def step_dir(local_dir: str, step: int) -> str:
    return os.path.join(checkpoint_root(local_dir), f"{PREFIX}{step}")


# ------------------------------------------------------------------------------------------------------------------
# RNG states
# ------------------------------------------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """This rank's RNG states, as plain tensors and numbers (loadable with weights_only=True)."""
    from megatron.core import tensor_parallel

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, py_state, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "python": {"version": version, "state": list(py_state), "gauss": gauss},
        "megatron": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
    tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ------------------------------------------------------------------------------------------------------------------
# save
# ------------------------------------------------------------------------------------------------------------------
def _agree(ok: bool) -> bool:
    """True on every rank iff `ok` on every rank."""
    return reduce_over_ranks([1 if ok else 0], dist.ReduceOp.MIN)[0] == 1


def save(run: Any, local_dir: str, step: int, trainer_state: dict, max_keep: Optional[int]) -> str:
    """Write global_step_<step> (replacing one of that step); collective over every rank. Returns its directory.

    Every failure is agreed before any rank enters another collective, so the ranks leave together: a failure all
    ranks see (a shard write, a rank-0 step they are told of) raises CheckpointError on every rank; one that only
    the failing rank can see (SaveAbandoned) ends the run from that rank, with the same message."""
    root, final = checkpoint_root(local_dir), step_dir(local_dir, step)
    token = [uuid.uuid4().hex[:8]]
    dist.broadcast_object_list(token, src=0)
    tmp = f"{final}.tmp-{token[0]}"
    rank = dist.get_rank()
    error: Optional[BaseException] = None
    try:
        rank0_step(lambda: os.makedirs(os.path.join(tmp, "rng")), f"creating {tmp}")
        for role in (run.roles.actor, run.roles.critic):
            if role is not None:
                save_model_checkpoint(role.chunks, os.path.join(tmp, role.name), optimizer=role.optimizer,
                                      scheduler_state=role.scheduler.state_dict(), dp_cp_group=run.ps.dp_cp_group)
                if rank == 0:
                    for name, text in role.adapter.checkpoint_files().items():
                        write_atomic(os.path.join(tmp, role.name, name), text)
        torch.save(rng_state(), os.path.join(tmp, "rng", f"rank_{rank}.pt"))
        if rank == 0:
            meta = {"step": step, "world_size": dist.get_world_size(), **trainer_state}
            with open(os.path.join(tmp, STATE_FILE), "w") as f:
                json.dump(meta, f, indent=1)
    except SaveAbandoned as e:
        leave_run(f"megappo train: {_failed(local_dir, step, e)}; every rank stops now (the others were waiting for "
                  "this one inside the save)")
    except (Exception, CheckpointException) as e:  # disk full, quota, permissions; torch's is a BaseException
        error = e
    try:
        agreed = _agree(error is None)
    except RuntimeError as e:  # a rank left the run (SaveAbandoned): the collective lost its connection
        raise CheckpointError(_failed(local_dir, step, None)) from e
    if not agreed:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        raise CheckpointError(_failed(local_dir, step, error)) from error

    def publish() -> None:
        _publish(tmp, final)
        write_atomic(os.path.join(root, TRACKER), str(step))
        _prune(root, max_keep)

    try:
        rank0_step(publish, f"publishing {tmp}")
    except CheckpointError as e:
        raise CheckpointError(_failed(local_dir, step, e)) from e
    return final


def _failed(local_dir: str, step: int, error: Optional[BaseException]) -> str:
    """What a failed save says: the directory, the cause, what is intact, and how to go on."""
    previous = latest_step(local_dir)
    kept = f"the previous checkpoint {step_dir(local_dir, previous)} is intact" if previous is not None else \
        "no earlier checkpoint exists"
    return (f"saving the step-{step} checkpoint into {checkpoint_root(local_dir)} failed ({_cause(error)}); {kept}. "
            "Free space there (or lower trainer.max_ckpt_to_keep), or point trainer.default_local_dir at a disk "
            "with room, and start the same command again to resume")


def _cause(error: Optional[BaseException]) -> str:
    """One line for the error: torch's CheckpointException carries each rank's whole traceback."""
    if error is None:
        return "on another rank"
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return lines[-1] if len(lines) > 1 else f"{type(error).__name__}: {lines[0] if lines else ''}"


def _publish(tmp: str, final: str) -> None:
    fsync_tree(tmp)
    old = None
    if os.path.exists(final):  # the same step saved again (a rolled-back run passing it a second time)
        old = f"{tmp}.old"
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(os.path.dirname(final))
    if old:
        shutil.rmtree(old, ignore_errors=True)


def _steps(root: str) -> list[int]:
    """The steps of the published checkpoint directories under `root`, ascending."""
    if not os.path.isdir(root):
        return []
    names = (d[len(PREFIX):] for d in os.listdir(root) if d.startswith(PREFIX))
    return sorted(int(n) for n in names if n.isdigit())


def _prune(root: str, max_keep: Optional[int]) -> None:
    if not max_keep:
        return
    for s in _steps(root)[:-max_keep]:
        shutil.rmtree(os.path.join(root, f"{PREFIX}{s}"), ignore_errors=True)


def remove_stale(local_dir: str) -> list[str]:
    """Delete what interrupted saves left (`.tmp-` and `.old` directories); rank 0, before anything else saves."""
    root = checkpoint_root(local_dir)
    stale = [d for d in (os.listdir(root) if os.path.isdir(root) else [])
             if d.startswith(PREFIX) and (".tmp-" in d or d.endswith(".old"))]
    for d in stale:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)
    if stale:
        print(f"megappo train: removed {len(stale)} unfinished checkpoint(s) of an interrupted save: {stale}",
              file=sys.stderr)
    return stale


# ------------------------------------------------------------------------------------------------------------------
# resume
# ------------------------------------------------------------------------------------------------------------------
def latest_step(local_dir: str) -> Optional[int]:
    """The newest complete checkpoint's step: the tracker's, else (killed between publishing a checkpoint and
    recording it) the newest published directory with its trainer state."""
    root = checkpoint_root(local_dir)
    tracker = os.path.join(root, TRACKER)
    if os.path.isfile(tracker):
        with open(tracker) as f:
            text = f.read().strip()
        if text.isdigit() and os.path.isfile(os.path.join(step_dir(local_dir, int(text)), STATE_FILE)):
            return int(text)
    complete = [s for s in _steps(root) if os.path.isfile(os.path.join(step_dir(local_dir, s), STATE_FILE))]
    return complete[-1] if complete else None


def find_resume_dir(local_dir: str, mode: str, resume_path: Optional[str]) -> Optional[str]:
    """The checkpoint to resume from (None: start fresh). auto: the newest complete one; resume_path: that one."""
    if mode == "disable":
        return None
    if mode == "resume_path":
        return os.path.abspath(os.path.expanduser(resume_path))
    step = latest_step(local_dir)
    if step is not None:
        return step_dir(local_dir, step)
    root = checkpoint_root(local_dir)
    if _steps(root):
        raise CheckpointError(
            f"{root} holds checkpoint directories {[f'{PREFIX}{s}' for s in _steps(root)]} but none is complete "
            f"(no {STATE_FILE}): remove them to start fresh, or set trainer.resume_mode=resume_path and "
            "trainer.resume_from_path to one you trust")
    return None


def load(run: Any, directory: str) -> dict:
    """Restore actor/critic weights, optimizers, schedulers and this rank's RNG states from `directory`; return its
    trainer state. Collective."""
    state_file = os.path.join(directory, STATE_FILE)
    if not os.path.isfile(state_file):
        raise CheckpointError(f"{state_file} is missing: {directory} is not a complete trainer checkpoint")
    with open(state_file) as f:
        saved = json.load(f)
    for role in (run.roles.actor, run.roles.critic):
        if role is not None:
            role.adapter.check_checkpoint(os.path.join(directory, role.name))
            loaded = load_model_checkpoint(role.chunks, os.path.join(directory, role.name), optimizer=role.optimizer,
                                           dp_cp_group=run.ps.dp_cp_group)
            if loaded.scheduler_state is not None:
                role.scheduler.load_state_dict(loaded.scheduler_state)
    rng_file = os.path.join(directory, "rng", f"rank_{dist.get_rank()}.pt")
    if saved.get("world_size") == dist.get_world_size() and os.path.isfile(rng_file):
        set_rng_state(torch.load(rng_file, weights_only=True))
    elif dist.get_rank() == 0:  # resharded: the weights are exact, the random streams start anew
        print(f"megappo train: {directory} was saved by {saved.get('world_size')} ranks, this run has "
              f"{dist.get_world_size()}: RNG states not restored", file=sys.stderr)
    return saved


def export_actor(run: Any, out_dir: str) -> str:
    """The actor as a complete Hugging Face directory (what transformers and SGLang load); collective."""
    roles = run.roles
    buckets = iter_hf_weights(roles.actor.chunks, run.ps, roles.hf_config, dtype=run.platform.dtype)
    return write_actor_hf_dir(buckets, roles.hf_config, roles.actor.hf_dir, out_dir, run.platform.dtype)


def write_actor_hf_dir(buckets: Any, hf_config: dict, side_files_from: str, out_dir: str, dtype: Any) -> str:
    """The actor's exported buckets (`iter_hf_weights`) as a complete Hugging Face directory with the tokenizer files
    of `side_files_from`; rank 0 writes, every rank drives the export. Collective."""
    items = (item for bucket in buckets for item in bucket)
    error: Optional[Exception] = None
    try:
        write_hf_dir(items, side_files_from, out_dir, dist.get_rank() == 0, force=True, max_shard_bytes=4 << 30,
                     progress=False, config=output_config(hf_config, "actor", dtype))
    except Exception as e:  # rank 0's disk: the other ranks are still gathering the buckets rank 0 stopped taking
        error = e
        for _ in items:
            pass
    if not _agree(error is None):
        raise CheckpointError(f"writing the actor's Hugging Face export to {out_dir} failed "
                              f"({_cause(error)}): free space there, or set trainer.default_local_dir (or "
                              "rollout.weight_sync_dir) to a disk with room") from error
    return out_dir
