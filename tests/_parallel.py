"""How the suite runs on several pytest-xdist workers (`-n 2`, pytest.ini) without its tests seeing each other.

- Scheduling (`Scheduler`, from the node ids alone: xdist's controller never collects): a test module is one
  unit, so its module-scoped fixtures (a warm start, a server) are built once; the modules that share a
  machine-wide resource run one after another on one worker: `engines` (files named for SGLang or vLLM: a session's
  servers and venvs), `slurm` (tests/cluster: the local cluster), `ray` (local Ray clusters). Not xdist's
  `loadgroup`: it renames nodes through `_nodeid`, which pytest 9 no longer has, so its groups are silently lost.
- `alone` tests read state of the whole machine (the sandbox's host checks: /tmp, SysV IPC, mounts, shared memory,
  every process of the sandbox's uids), so nothing runs beside them: each test holds a reader-writer lock, shared
  for the rest and exclusive for `alone` ones. A waiting `alone` test holds the gate, so the other worker cannot
  start a test and starve it.
- `built_once`: a session fixture's folder made by one worker under a lock; the others wait and read it.
"""
from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import pytest
from xdist.scheduler import LoadScopeScheduling

RAY_FILES = ("test_ray_launch.py", "test_rewards_ray.py", "test_tool_pool.py", "test_reward_job_signals.py")


def group_of(nodeid: str) -> str:
    """The unit of work a test belongs to: a shared resource's group, else its module."""
    path = nodeid.split("::")[0]
    name = path.rsplit("/", 1)[-1]
    if path.startswith("tests/cluster/"):
        return "slurm"
    if "sglang" in name or "vllm" in name:
        return "engines"
    return "ray" if name in RAY_FILES else path


class Scheduler(LoadScopeScheduling):
    """xdist's load-scope scheduling over `group_of`'s units."""

    def _split_scope(self, nodeid: str) -> str:
        return group_of(nodeid)


def _shared_root(factory: pytest.TempPathFactory) -> Path:
    """A folder every worker of this run sees: the parent of the workers' basetemps (the basetemp itself without
    xdist)."""
    base = factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextmanager
def _flock(path: Path, mode: int) -> Iterator[None]:
    with open(path, "a+") as f:
        fcntl.flock(f, mode)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextmanager
def machine_turn(item: pytest.Item) -> Iterator[None]:
    """Hold the suite's reader-writer lock for one test: exclusive for `alone` tests, shared otherwise."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    root = _shared_root(item.config._tmp_path_factory)  # noqa: SLF001 (a hook's only handle on it)
    gate, turn = root / "machine.gate", root / "machine.lock"
    if item.get_closest_marker("alone"):
        with open(turn, "a+") as f:
            with _flock(gate, fcntl.LOCK_EX):
                fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
        return
    with _flock(gate, fcntl.LOCK_EX):
        pass  # waits while an `alone` test waits
    with _flock(turn, fcntl.LOCK_SH):
        yield


def exclusive(path: Path):
    """An exclusive lock on the file `path` (made if missing), for one process at a time."""
    return _flock(path, fcntl.LOCK_EX)


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """`root/name`, made by `build(path)` once for all workers of the run (a `.done` file marks it made)."""
    root = _shared_root(tmp_path_factory)
    out = root / name
    with _flock(root / f"{name}.lock", fcntl.LOCK_EX):
        if not (out / ".done").exists():
            out.mkdir(parents=True, exist_ok=True)
            build(out)
            (out / ".done").write_text("ok\n")
    return out
