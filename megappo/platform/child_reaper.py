"""Nothing a run starts outlives it: the parent-death rule for the helper processes megappo starts.

However a run ends (its last line, an exception, Ctrl-C, SIGTERM, or SIGKILL from an OOM killer or a node agent,
which runs no handler at all), every process it started ends with it:

- SGLang servers run under a watchdog (`megappo/platform/reaper.py`) that kills the server's whole process group when
  the trainer dies; the watchdog and the server get the kernel's parent-death signal (Linux `PR_SET_PDEATHSIG`).
- Reward workers (`megappo/rewards/_worker.py`) get the parent-death signal SIGKILL.
- Checkpoint writers: megatron's asynchronous-capable writer (`FileSystemWriterAsync`) would start a multiprocessing
  manager server (a spawned process, plus multiprocessing's resource tracker) at the first save and keep it for the
  life of the process, where a SIGKILL orphans both forever, and fork its shard-writing workers with no parent-death
  rule. megappo saves through `megappo.models.save_strategy`, which needs no manager (the save is synchronous: its
  results stay in this process) and forks the workers with `fork_process` below.

- The ranks themselves, under torchrun: torchrun starts each rank in a session of its own, so a SIGKILL of
  torchrun's process group (a job killed by an OOM killer or a node agent) leaves the ranks training on.
  `die_with_launcher()`, called by a rank at start-up, ends the rank and its process group when its launcher dies.

`fork_process` is the one way megappo forks a worker: the child asks for SIGKILL on its parent's death before it runs
anything, and leaves at once if the parent is already gone. The parent-death signal is the same prctl the SGLang
watchdog uses (`megappo.platform.reaper.set_parent_death_signal`). It is delivered when the *thread* that forked the
child exits; the caller waits for its workers in the same thread, so that is the process's death. Where there is no
prctl (not Linux) a worker outlives its parent only as long as it takes to finish its own task.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from multiprocessing.context import ForkProcess
from typing import Any, Callable, Optional

from megappo.platform.reaper import set_parent_death_signal

__all__ = ["die_with_launcher", "die_with_parent", "fork_process", "DyingWithParentProcess"]


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> bool:
    """In a child of `parent_pid`: have the kernel send `sig` when the parent dies, and exit now (code 1) if the
    parent died before the request took effect. False where the kernel cannot do it (not Linux)."""
    armed = set_parent_death_signal(sig)
    if os.getppid() != parent_pid:
        os._exit(1)
    return armed


class DyingWithParentProcess(ForkProcess):
    """A forked `multiprocessing` process that dies with the process that started it (SIGKILL included)."""

    def start(self) -> None:
        self._megappo_parent = os.getpid()
        super().start()

    def run(self) -> None:
        die_with_parent(self._megappo_parent)
        super().run()


def fork_process(target: Callable[..., Any], args: tuple = (), kwargs: Optional[dict] = None,
                 name: Optional[str] = None) -> DyingWithParentProcess:
    """A not yet started forked process running `target(*args, **kwargs)` that dies with this process."""
    if "fork" not in multiprocessing.get_all_start_methods():
        raise RuntimeError("fork_process needs the fork start method (POSIX)")
    return DyingWithParentProcess(target=target, args=args, kwargs=kwargs or {}, name=name)


LAUNCHER_POLL_S = 0.5
_launcher_watch: Optional[threading.Thread] = None


def die_with_launcher(poll_s: float = LAUNCHER_POLL_S) -> bool:
    """Under torchrun (TORCHELASTIC_RUN_ID set): end this rank, and the process group it leads, within `poll_s`
    seconds of its launcher's death, however the launcher dies. Elsewhere (a plain process, another launcher) it
    does nothing and returns False. Idempotent.

    torchrun starts every rank with `start_new_session`, out of reach of a signal to torchrun's process group, and
    a SIGKILLed torchrun cannot pass it on. A daemon thread watches getppid() (not the kernel's parent-death signal:
    that fires when the launcher's *thread* that started the rank exits, which need not be the launcher's death)
    and SIGKILLs the rank's group when the parent changes: a rank whose launcher is gone has lost its rendezvous
    store and its peers' supervisor, and nothing it could still do would be used."""
    global _launcher_watch
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    if _launcher_watch is not None:
        return True
    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(poll_s)
        pid = os.getpid()
        try:
            if os.getpgid(0) == pid:  # a group leader (as torchrun makes each rank): its forks go with it
                os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        os.kill(pid, signal.SIGKILL)

    _launcher_watch = threading.Thread(target=watch, name="megappo-launcher-watch", daemon=True)
    _launcher_watch.start()
    return True
