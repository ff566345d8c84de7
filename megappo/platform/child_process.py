"""Helper processes megappo spawns and talks to over a pipe: the in-process rollout engine's child
(`megappo/rollout/hf/process.py`) and the reward workers (`megappo/rewards/scorer.py`).

Parent side: `spawn_child(target, args, name)` starts `target(conn, parent_pid, *args)` in a spawned process (never
forked: the trainer holds gloo process groups and threads) under `job_signals_blocked()`, so no job-wide signal
reaches it before it ignores them; it returns the process and this side's end of a duplex pipe (the child's end is
closed here, so this end reads EOF when the child dies).

Child side: `enter_child(parent_pid, ...)` first thing: ignore the job-wide signals (a pending one is discarded),
optionally lead a process group of its own, arm the kernel's parent-death SIGKILL (it fires when the *thread* that
started the child exits, so only a child started from the main thread arms it) and optionally watch getppid().

Errors cross the pipe as `pickled_error(e)` (the exception when it pickles, and its formatted traceback) and come out
as `unpickled_error(payload, ...)`, the child's exception with its traceback as the `__cause__`.

Standard library only: a reward worker imports this and starts in a fraction of a second.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import threading
import time
import traceback
from typing import Any, Callable, Optional

from megappo.platform.child_reaper import die_with_parent
from megappo.platform.job_signals import ignore_job_signals, job_signals_blocked

__all__ = ["ChildTraceback", "enter_child", "pickled_error", "spawn_child", "unpickled_error"]

PARENT_POLL_S = 0.2  # the child's getppid() watch


def spawn_child(target: Callable[..., Any], args: tuple, name: str, ctx: Any = None) -> tuple[Any, Any]:
    """Start `target(conn, parent_pid, *args)` in a spawned daemon process; (the process, this side's conn)."""
    ctx = ctx if ctx is not None else multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=target, args=(child_conn, os.getpid(), *args), daemon=True, name=name)
    with job_signals_blocked():  # until the child ignores them
        proc.start()
    child_conn.close()  # so this end reads EOF when the child dies
    return proc, conn


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


def enter_child(parent_pid: int, *, arm_pdeathsig: bool = True, watch_parent: bool = False,
                own_group: bool = False) -> None:
    """In a child started by `spawn_child`: ignore the job signals, lead a process group of its own (`own_group`:
    killing the group reaches whatever the child starts), die with the parent (the kernel's parent-death SIGKILL
    when `arm_pdeathsig`, a getppid() watch every 0.2 s when `watch_parent`); exits at once if the parent is gone."""
    ignore_job_signals()  # started with them blocked: a pending one is discarded here
    if own_group:
        os.setpgrp()
    if arm_pdeathsig:
        die_with_parent(parent_pid)  # exits now if the parent is already gone
    elif os.getppid() != parent_pid:
        os._exit(1)
    if watch_parent:
        threading.Thread(target=_watch_parent, args=(parent_pid,), name="megappo-parent-watch", daemon=True).start()


class ChildTraceback(Exception):
    """The traceback of an exception raised in a child process (the __cause__ of the re-raised one)."""


def pickled_error(e: BaseException) -> tuple[Optional[bytes], str]:
    """`e` to send over the pipe: (the pickled exception, or None when it does not pickle; its traceback)."""
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    try:
        return pickle.dumps(e), tb
    except Exception:
        return None, tb


def unpickled_error(payload: tuple[Optional[bytes], str], *, failed: str, where: str) -> BaseException:
    """The exception of `pickled_error`'s payload (RuntimeError "{failed}:\\n{traceback}" when it does not
    unpickle), with the child's traceback, introduced by "(in {where})", as its cause."""
    blob, tb = payload
    err: Optional[BaseException] = None
    if blob is not None:
        try:
            err = pickle.loads(blob)
        except Exception:
            err = None
    if not isinstance(err, BaseException):
        err = RuntimeError(f"{failed}:\n{tb}")
    err.__cause__ = ChildTraceback(f"\n({where})\n{tb}")
    return err
