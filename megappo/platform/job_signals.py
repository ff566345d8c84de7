"""The job-wide signals, and starting helper processes that outlive none of them.

Slurm signals every process of a job step (preemption's SIGTERM, `--signal`, `scancel --signal [--full]`, srun's
SIGINT). The trainer's helpers (reward workers, a Ray it starts, SGLang servers) must not die of them under the
step the trainer finishes before it saves: the trainer alone decides when they stop (SIGKILL at the latest).

A helper is started under `job_signals_blocked()`: it inherits the blocked mask (through exec too), so no job signal
reaches it before it ignores them itself (`ignore_job_signals()`; a pending one is then discarded). The SGLang
watchdog and launcher wrapper (`platform/reaper.py`, `rollout/ignore_job_signals.py`) run on SGLang's python without
megappo, and keep their own copy of the tuple. Standard library only: reward workers import this.
"""
from __future__ import annotations

import contextlib
import signal
from typing import Iterator

JOB_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


@contextlib.contextmanager
def job_signals_blocked() -> Iterator[None]:
    """Block JOB_SIGNALS in this thread while it starts helper processes. This process still gets them: Linux hands
    a process-wide signal to a thread that does not block it, and one that found every thread blocking it is
    delivered here on unblocking.

    multiprocessing's resource tracker, started with the first spawned process, unblocks SIGINT and SIGTERM in the
    starting thread once it runs (CPython's `resource_tracker.ensure_running`): a worker spawned after that, inside
    this block, would start with them deliverable. It is started first, and the block applied again."""
    from multiprocessing import resource_tracker

    old = signal.pthread_sigmask(signal.SIG_BLOCK, JOB_SIGNALS)
    try:
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, JOB_SIGNALS)
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def ignore_job_signals() -> None:
    """In a helper started under job_signals_blocked: ignore JOB_SIGNALS (they stay blocked, for what it starts)."""
    for sig in JOB_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
