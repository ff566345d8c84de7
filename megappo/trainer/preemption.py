"""Stopping in time: SIGTERM/SIGUSR1 (what Slurm sends before preemption or the time limit), Ctrl-C (SIGINT) and
`trainer.save_before_deadline`.

The first signal asks the run to stop after the step in progress: fit then saves a checkpoint, stops its rollout
servers and reward workers, writes `<default_local_dir>/run_status.json` with `"status": "preempted"`, and exits
with EXIT_REQUEUE (75, sysexits' EX_TEMPFAIL: "try again later"), which a batch script requeues on. Under torchrun
the workers' status is reported as torchrun's own failure (1), so launch scripts read run_status.json instead. A
second signal stops at once (the last checkpoint stays valid: saves are atomic), unless it comes within
REPEAT_WINDOW_S of the first: one stop request often arrives twice (Slurm's preemption SIGTERM and `scancel --full`
reach every process of the job, the ranks directly and again through the batch script and launch/torchrun.sh,
which pass it on), and the copy must not cost the checkpoint.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Optional

import torch.distributed as dist

from megappo.config import ConfigError
from megappo.config.deadline import deadline_refusal, parse_deadline
from megappo.parallel import reduce_over_ranks
from megappo.trainer.files import write_atomic

EXIT_REQUEUE = 75
STATUS_FILE = "run_status.json"
# SIGINT is a person's Ctrl-C (passed on to every rank by launch/torchrun.sh or torchrun; srun sends it to every
# process of the step): treated as SIGTERM, so the work since the last checkpoint is kept. A second Ctrl-C stops at
# once, unless it comes within COPY_WINDOW_S: a relayed copy (srun's, then torchrun's) arrives within milliseconds,
# a person's second press a good fraction of a second later.
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
EXIT_INTERRUPTED = 128 + signal.SIGINT
COPY_WINDOW_S = 0.3
REPEAT_WINDOW_S = 5.0  # a relayed copy measured well under a second on a local Slurm; a person's second try is slower


class StopRequest:
    """Whether the run should save and stop now: a signal arrived, or the deadline is closer than a step and a save."""

    def __init__(self, deadline: Optional[str], repeat_window_s: float = REPEAT_WINDOW_S):
        refusal = deadline_refusal(deadline) if deadline else None  # "slurm" outside a Slurm job
        if refusal:
            raise ConfigError(refusal)
        self.deadline = parse_deadline(deadline) if deadline else None
        self.signal: Optional[str] = None
        self.repeat_window_s = repeat_window_s
        self._first_at = 0.0  # time.monotonic() of the first signal
        self._previous: dict[int, object] = {}
        self._step_s = 0.0  # the longest step so far
        self._save_s = 0.0  # the longest save so far

    def install(self) -> None:
        """Install the handlers; call after anything that installs its own (ray.init, SGLang's launcher)."""
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, _frame) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            return self._interrupt()
        if self.signal is not None:
            if time.monotonic() - self._first_at < self.repeat_window_s:
                print(f"megappo train: {name} again within {self.repeat_window_s:.0f} s: taken as a copy of the "
                      "first (still saving after this step)", file=sys.stderr, flush=True)
                return
            raise SystemExit(128 + signum)  # asked twice: stop now
        self.signal, self._first_at = name, time.monotonic()
        print(f"megappo train: {name} received: saving a checkpoint after this step and stopping (send it again "
              f"after {self.repeat_window_s:.0f} s to stop at once)", file=sys.stderr, flush=True)

    def _interrupt(self) -> None:
        says = int(os.environ.get("RANK", "0")) == 0  # every rank gets it (torchrun passes it on); one says it
        if self.signal is not None:
            if time.monotonic() - self._first_at < COPY_WINDOW_S:
                return
            if says:
                print("megappo train: Ctrl-C again: stopping now, without saving this step (the last checkpoint "
                      "stays)", file=sys.stderr, flush=True)
            sys.stdout.flush()
            # not SystemExit: raised inside a callback (logging's fork hooks, a __del__) it is printed and dropped,
            # and the run goes on. Nothing is lost by leaving now: saves are atomic, the helpers die with this
            # process (parent-death signal, server watchdogs) and the kernel drops the directory lock.
            os._exit(EXIT_INTERRUPTED)
        self.signal, self._first_at = "SIGINT", time.monotonic()
        if says:
            print("megappo train: Ctrl-C: finishing this step, saving a checkpoint and exiting with 75 (run the same "
                  "command to resume); Ctrl-C again stops at once, without saving", file=sys.stderr, flush=True)

    def timed(self, step_s: float = 0.0, save_s: float = 0.0) -> None:
        self._step_s, self._save_s = max(self._step_s, step_s), max(self._save_s, save_s)

    def reason(self) -> Optional[str]:
        """Why to stop now, agreed by every rank (collective): a signal reached any rank, or the next step and a
        save would end past the deadline."""
        why = 0
        if self.signal is not None:
            why = 2
        elif self.deadline is not None and time.time() + 1.5 * (self._step_s + self._save_s) > self.deadline:
            why = 1
        why = int(reduce_over_ranks([why], dist.ReduceOp.MAX)[0])
        return {0: None, 1: "trainer.save_before_deadline is near", 2: f"{self.signal or 'a signal'} received"}[why]


def write_status(local_dir: str, status: str, step: int, **extra) -> None:
    """`<local_dir>/run_status.json`: how the run ended (finished, preempted, stopped) and at which step; rank 0.
    Also `$MEGAPPO_STATUS_FILE` when set, by each node's local rank 0."""
    text = json.dumps({"status": status, "step": step, "time": time.time(), **extra})
    launcher_file = os.environ.get("MEGAPPO_STATUS_FILE")
    if launcher_file and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        # launch/torchrun.sh's fresh file for this invocation: every node's launcher turns it into its exit status
        # (torchrun's own is 1 for any failing worker), and run_status.json is on rank 0's node only, possibly left
        # by an earlier run
        write_atomic(launcher_file, text)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    os.makedirs(local_dir, exist_ok=True)
    write_atomic(os.path.join(local_dir, STATUS_FILE), text)
