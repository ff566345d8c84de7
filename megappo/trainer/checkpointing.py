"""Trainer checkpoints, resume, and the final Hugging Face export of the actor.

Layout: `<default_local_dir>/checkpoints/global_step_<N>/{actor,critic}/` (megatron dist_checkpoints with optimizer
and LR-scheduler state, each written atomically by `save_model_checkpoint`) and `trainer_state.json` (step, data
position, KL controller, rollout weight version), written last. Only then is `latest_checkpointed_iteration.txt`
updated, so resume never takes a half-written checkpoint.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Optional

import torch.distributed as dist

from megappo.convert.export import iter_hf_weights
from megappo.convert.mcore_to_hf import output_config, write_hf_dir
from megappo.models.checkpoint import CheckpointError, load_model_checkpoint, save_model_checkpoint

TRACKER = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.json"


def checkpoint_root(local_dir: str) -> str:
    return os.path.join(local_dir, "checkpoints")


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(run: Any, local_dir: str, step: int, trainer_state: dict, max_keep: Optional[int]) -> str:
    """Write global_step_<step>; collective over every rank. Returns its directory."""
    root = checkpoint_root(local_dir)
    directory = os.path.join(root, f"global_step_{step}")
    roles = run.roles
    for role in (roles.actor, roles.critic):
        if role is not None:
            save_model_checkpoint(role.chunks, os.path.join(directory, role.name), optimizer=role.optimizer,
                                  scheduler_state=role.scheduler.state_dict(), dp_cp_group=run.ps.dp_cp_group)
    if dist.get_rank() == 0:
        _write_atomic(os.path.join(directory, STATE_FILE), json.dumps({"step": step, **trainer_state}, indent=1))
        _write_atomic(os.path.join(root, TRACKER), str(step))
        _prune(root, max_keep)
    dist.barrier()
    return directory


def _prune(root: str, max_keep: Optional[int]) -> None:
    if not max_keep:
        return
    steps = sorted(int(d.split("_")[-1]) for d in os.listdir(root)
                   if d.startswith("global_step_") and d.split("_")[-1].isdigit())
    for s in steps[:-max_keep]:
        shutil.rmtree(os.path.join(root, f"global_step_{s}"), ignore_errors=True)


def find_resume_dir(local_dir: str, mode: str, resume_path: Optional[str]) -> Optional[str]:
    """The checkpoint to resume from (None: start fresh). auto: the tracker's; resume_path: that directory."""
    if mode == "disable":
        return None
    if mode == "resume_path":
        return os.path.abspath(os.path.expanduser(resume_path))
    root = checkpoint_root(local_dir)
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        if os.path.isdir(root) and any(d.startswith("global_step_") for d in os.listdir(root)):
            raise CheckpointError(f"{root} holds checkpoints but no complete one ({TRACKER} is missing); remove "
                                  "the directory to start fresh or set trainer.resume_mode=resume_path")
        return None
    with open(tracker) as f:
        return os.path.join(root, f"global_step_{int(f.read().strip())}")


def load(run: Any, directory: str) -> dict:
    """Restore actor/critic weights, optimizers and schedulers from `directory`; return its trainer state."""
    state_file = os.path.join(directory, STATE_FILE)
    if not os.path.isfile(state_file):
        raise CheckpointError(f"{state_file} is missing: {directory} is not a complete trainer checkpoint")
    for role in (run.roles.actor, run.roles.critic):
        if role is not None:
            loaded = load_model_checkpoint(role.chunks, os.path.join(directory, role.name), optimizer=role.optimizer,
                                           dp_cp_group=run.ps.dp_cp_group)
            if loaded.scheduler_state is not None:
                role.scheduler.load_state_dict(loaded.scheduler_state)
    with open(state_file) as f:
        return json.load(f)


def export_actor(run: Any, out_dir: str) -> str:
    """The actor as a complete Hugging Face directory (what transformers and SGLang load); collective."""
    roles = run.roles
    items = (item for bucket in iter_hf_weights(roles.actor.chunks, run.ps, roles.hf_config,
                                                dtype=run.platform.dtype) for item in bucket)
    write_hf_dir(items, roles.actor.hf_dir, out_dir, dist.get_rank() == 0, force=True, max_shard_bytes=4 << 30,
                 progress=False, config=output_config(roles.hf_config, "actor", run.platform.dtype))
    dist.barrier()
    return out_dir
