"""A run owns its output directory (`trainer.default_local_dir`): global rank 0 holds an exclusive lock on
`<dir>/.megappo.lock` from before anything in the directory is read or removed until teardown.

Without it a second run on the same directory (a double submit, a requeued Slurm job whose previous incarnation is
still exiting, a copy-pasted command) resumes from checkpoints the first is still writing, and removes the `.tmp-`
directory of the first one's save in progress as an "interrupted save".

The lock is a POSIX record lock (`fcntl.lockf`): the kernel drops it when its process dies, SIGKILL included, and
NFS (v3 through lockd, v4 natively) and the parallel filesystems of Slurm clusters (Lustre mounted with `flock`,
GPFS, BeeGFS) honour it across nodes, where `flock` is node-local on some of them. Two properties of POSIX locks
shape this module: a process's lock on a file goes away when the process closes *any* descriptor of that file (so
the holder reads and writes the file only through its own descriptor), and a process never conflicts with itself (a
second lock in the same process succeeds: in-process callers such as tests run fit one after another, not at once).

The holder writes its host, pid, start time and Slurm job into the file, so a second run can name it.
"""
from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import time
from typing import Optional

from megappo.config import ConfigError

LOCK_FILE = ".megappo.lock"
POLL_S = 1.0  # between tries while waiting: the holder's exit is noticed within a second


class DirLocked(ConfigError):
    """Another run holds the directory: `megappo train` prints the message as it is (not as a list of config
    problems) and exits 1, as for a configuration error."""

    def __init__(self, message: str):
        self.errors = [message]
        ValueError.__init__(self, message)


class AlreadyFinished(Exception):
    """The directory holds a finished run: nothing to do (`fit` returns 0 without training)."""


class RunLock:
    """The lock on `<directory>/.megappo.lock`. `acquire(wait_s)` in one process; `poll(deadline)` for a caller that
    must do something between tries (build.py broadcasts each outcome to the other ranks)."""

    def __init__(self, directory: str):
        self.directory = os.path.abspath(directory)
        self.path = os.path.join(self.directory, LOCK_FILE)
        self._fd: Optional[int] = None
        self.held = False
        self._announced = False

    def _open(self) -> int:
        if self._fd is None:
            os.makedirs(self.directory, exist_ok=True)
            # read-write: an exclusive POSIX lock needs a descriptor open for writing
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        return self._fd

    def try_acquire(self) -> bool:
        """Take the lock if it is free (no waiting); on success write who holds it."""
        if self.held:
            return True
        fd = self._open()
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):  # EAGAIN or EACCES, depending on the system
            return False
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            # a filesystem without locks (NFS mounted with nolock, no lockd): refusing would leave no way to train
            # there at all, so say what is not guarded and go on
            print(f"megappo train: WARNING: {self.path} cannot be locked ({os.strerror(e.errno)}): this run does "
                  "not keep a second one out of the directory; start one run per trainer.default_local_dir",
                  file=sys.stderr, flush=True)
            return True
        self.held = True
        info = {"host": socket.gethostname(), "pid": os.getpid(),
                "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
        if os.environ.get("SLURM_JOB_ID"):
            info["slurm_job"] = os.environ["SLURM_JOB_ID"]
        data = (json.dumps(info) + "\n").encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)  # a run on another node reads it through the shared filesystem
        return True

    def holder(self) -> Optional[dict]:
        """What the holder wrote (None: nothing readable yet, e.g. it has locked but not written)."""
        try:
            text = os.pread(self._open(), 4096, 0).decode(errors="replace")
            info = json.loads(text) if text.strip() else None
        except (OSError, ValueError):
            return None
        return info if isinstance(info, dict) else None

    def describe_holder(self) -> str:
        info = self.holder()
        if not info:
            return "another process (it has not written its host and pid yet)"
        where = f"pid {info.get('pid', '?')} on {info.get('host', '?')}"
        if info.get("slurm_job"):
            where += f" (Slurm job {info['slurm_job']})"
        return f"{where}, running since {info.get('since', '?')}"

    def locked_message(self, waited_s: float) -> str:
        info = self.holder() or {}
        waited = f" (waited {waited_s:.0f} s for it)" if round(waited_s) > 0 else ""
        ways = [f"`kill {info['pid']}` on {info.get('host', 'its host')}"] if info.get("pid") else []
        ways += [f"`scancel {info['slurm_job']}`"] if info.get("slurm_job") else []
        stop = "stop it" + (f" ({', or '.join(ways)})" if ways else "")
        return (f"{self.directory} is in use by another megappo run: {self.describe_holder()}{waited}; it holds "
                f"{self.path}. Wait for it to finish or {stop} and start again, or point "
                "trainer.default_local_dir at another directory. To wait for it instead, set "
                "trainer.dir_lock_wait_s=SECONDS (launch/slurm/*.sbatch wait 300 s)")

    def poll(self, deadline: float, poll_s: float = POLL_S) -> str:
        """One try: "ok" (held now), "wait" (not yet; slept up to `poll_s`, the deadline not passed) or "locked"
        (the deadline, a time.monotonic() value, has passed). Says once that it waits, and for whom."""
        if self.try_acquire():
            if self._announced:
                print(f"megappo train: {self.directory} is free now: this run holds it", file=sys.stderr, flush=True)
            return "ok"
        left = deadline - time.monotonic()
        if left <= 0:
            return "locked"
        if not self._announced:
            self._announced = True
            print(f"megappo train: {self.directory} is in use by another megappo run ({self.describe_holder()}); "
                  f"waiting up to {left:.0f} s (trainer.dir_lock_wait_s) for it to end", file=sys.stderr, flush=True)
        time.sleep(min(poll_s, left))
        return "wait"

    def acquire(self, wait_s: float = 0.0, poll_s: float = POLL_S) -> "RunLock":
        """Take the lock, waiting up to `wait_s` seconds for its holder to let go; DirLocked naming the holder when
        it does not."""
        start = time.monotonic()
        deadline = start + max(0.0, wait_s)
        while (verdict := self.poll(deadline, poll_s)) == "wait":
            pass
        if verdict == "locked":
            message = self.locked_message(time.monotonic() - start)
            self.close()
            raise DirLocked(message)
        return self

    def release(self) -> None:
        """Let go (idempotent). The file stays: removing it would let two runs lock two different files."""
        if self._fd is not None and self.held:
            try:
                os.ftruncate(self._fd, 0)  # no stale name for the next run to read while a new holder writes
                fcntl.lockf(self._fd, fcntl.LOCK_UN)
            except OSError:
                pass  # the descriptor's close below releases it anyway
        self.held = False
        self.close()

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
        self.held = False

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def finished_message(local_dir: str, total_steps: Optional[int]) -> Optional[str]:
    """Why a run in `local_dir` has nothing left to do, or None. Finished: `run_status.json` says "finished" at the
    step this run would end at (`total_steps`; None when it is not known yet), and the newest checkpoint, if any, is
    that step. A larger total_training_steps (train on) or an interrupted later run (status "preempted") are not
    finished."""
    from megappo.trainer import checkpointing
    from megappo.trainer.preemption import STATUS_FILE

    path = os.path.join(local_dir, STATUS_FILE)
    try:
        with open(path) as f:
            status = json.load(f)
        step = int(status["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if status.get("status") != "finished" or (total_steps is not None and step != total_steps):
        return None
    latest = checkpointing.latest_step(local_dir)
    if latest is not None and latest != step:
        return None
    return (f"megappo train: {local_dir} already finished at step {step} ({path}); nothing to do. Use another "
            "trainer.default_local_dir, or trainer.resume_mode=disable to train again from the start (that "
            "replaces this run's outputs), or a larger trainer.total_training_steps to train on")
