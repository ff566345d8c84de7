"""Batch scoring of generated responses with rule reward functions, in parallel and fault-tolerant.

`RewardScorer.score(items)` returns one score per sample. A sample whose function raises, returns something that
is not a score, kills its worker, or runs past `timeout_s` gets `failure_score` and is counted; the batch always
completes. Backends:

- "process": `num_workers` long-lived worker processes (spawned, torch-free, one process group each). A sample
  past its deadline has its worker's whole process group killed and a fresh worker started in its place.
- "ray": Ray tasks, at most `num_workers` in flight, on the cluster at `ray_address` ("auto" joins a running one)
  or on a local one started here; a task past its deadline is cancelled with force (its worker process is killed).
- "serial": in this process, for debugging. Exceptions are caught but a timeout cannot be enforced.

Workers are the trainer's helpers: Slurm's job-wide signals (SIGTERM, SIGINT, SIGUSR1 to every process of the job,
as on preemption) must not end them while the trainer finishes its step. Process workers and a Ray started here
begin with those signals blocked (`job_signals_blocked`), and process workers ignore them; `close()` ends them with
SIGKILL (Ray: after a second's SIGTERM), and a worker dies with the trainer (its parent-death SIGKILL).
"""
from __future__ import annotations

import collections
import math
import multiprocessing as mp
import os
import pickle
import signal
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_connections
from typing import Any, Callable, Literal, Sequence

import torch

from megappo.platform.child_process import spawn_child
from megappo.platform.job_signals import JOB_SIGNALS, job_signals_blocked
from megappo.rewards._worker import Outcome, evaluate, worker_main
from megappo.rewards.registry import RewardFunctionError, default_compute_score

_MAX_ERRORS_KEPT = 8
_WORKER_START_TIMEOUT_S = 120.0  # spawn + import of the user's reward file; generous for a loaded machine


@dataclass
class ScoreItem:
    """One response to score."""

    data_source: str  # picks the registered function when no custom function is set
    solution_str: str  # the decoded response
    ground_truth: Any  # the dataset's reward_model.ground_truth
    extra_info: dict | None = None  # the dataset's extra_info row
    prompt: str = ""  # the decoded prompt (a generative judge reads it as the question)
    group: int | None = None  # the prompt's group in the step (its uid): a pairwise judge compares within it


@dataclass
class ScoreResult:
    scores: torch.Tensor  # [B] float32: each sample's score; failure_score where failed or timed out
    extras: dict[str, torch.Tensor]  # name -> [B] float32: other numeric keys of returned dicts; NaN where absent
    failed: torch.Tensor  # [B] bool: raised, returned a non-score, or its worker died
    timed_out: torch.Tensor  # [B] bool: ran past timeout_s
    errors: list[str] = field(default_factory=list)  # the first few failure messages, "sample i: ..."
    # [B] bool: a sample whose group trains on nothing this step (a judge's unparsed verdict, on_unparsed=skip)
    skipped: torch.Tensor | None = None
    stats: dict[str, float] = field(default_factory=dict)  # other scalars for the logger, full names (a judge's)

    @property
    def num_failed(self) -> int:
        return int(self.failed.sum())

    @property
    def num_timeout(self) -> int:
        return int(self.timed_out.sum())

    def metrics(self, prefix: str = "reward/") -> dict[str, float]:
        """Scalars for the logger: mean score, failure and timeout counts, and the mean of each extra."""
        out = {
            f"{prefix}score_mean": float(self.scores.mean()) if self.scores.numel() else 0.0,
            f"{prefix}num_failed": float(self.num_failed),
            f"{prefix}num_timeout": float(self.num_timeout),
        }
        for name, values in self.extras.items():
            out[f"{prefix}{name}"] = float(values.nanmean()) if values.numel() else math.nan
        out.update(self.stats)
        return out


class RewardScorer:
    """Scores batches of `ScoreItem`s with `fn` (None: the registry by data_source) on the chosen backend.

    `fn` must reach the workers by reference: a module-level function, or `load_custom_reward_fn(path, name)`
    (pickled as path and name, re-imported in each worker). Use it as a context manager or call `close()`.
    """

    def __init__(
        self,
        fn: Callable | None = None,
        num_workers: int = 2,
        backend: Literal["process", "ray", "serial"] = "process",
        timeout_s: float = 30.0,
        failure_score: float = 0.0,
        ray_address: str | None = None,
    ):
        if backend not in ("process", "ray", "serial"):
            raise ValueError(f"reward_model.backend must be process, ray or serial, got {backend!r}")
        if num_workers < 1:
            raise ValueError(f"reward_model.num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"reward_model.timeout_s must be > 0, got {timeout_s}")
        self.fn = fn if fn is not None else default_compute_score
        self.num_workers = num_workers
        self.backend = backend
        self.timeout_s = float(timeout_s)
        self.failure_score = float(failure_score)
        self.ray_address = ray_address
        if backend != "serial":
            try:
                pickle.dumps(self.fn)
            except Exception as e:
                raise ValueError(
                    f"reward function {self.fn!r} cannot be sent to worker processes ({type(e).__name__}: {e}); "
                    "define it at module level or in a file loaded with custom_reward_function.path/.name, or use "
                    "reward_model.backend=serial"
                ) from e
        self._pool: _ProcessPool | None = None
        self._ray: _RayRunner | None = None

    # -- public -------------------------------------------------------------------------------------------------
    def score(self, items: Sequence[ScoreItem]) -> ScoreResult:
        tasks = [(it.data_source, it.solution_str, it.ground_truth, it.extra_info) for it in items]
        if not tasks:
            outcomes, timed_out = [], []
        elif self.backend == "serial":
            outcomes, timed_out = [evaluate(self.fn, t) for t in tasks], [False] * len(tasks)
        elif self.backend == "process":
            if self._pool is None:
                self._pool = _ProcessPool(self.fn, self.num_workers)
            try:
                outcomes, timed_out = self._pool.run(tasks, self.timeout_s)
            except BaseException:  # Ctrl-C or a worker that cannot load: leave no half-busy workers behind
                self._pool.close()
                self._pool = None
                raise
        else:
            if self._ray is None:
                self._ray = _RayRunner(self.fn, self.num_workers, self.ray_address)
            outcomes, timed_out = self._ray.run(tasks, self.timeout_s)
        return self._collect(outcomes, timed_out)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._ray is not None:
            self._ray.close()
            self._ray = None

    def __enter__(self) -> "RewardScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------------------------
    def _collect(self, outcomes: list[Outcome | None], timed_out: list[bool]) -> ScoreResult:
        n = len(outcomes)
        scores = torch.full((n,), self.failure_score, dtype=torch.float32)
        failed = torch.zeros(n, dtype=torch.bool)
        extras: dict[str, torch.Tensor] = {}
        errors: list[str] = []
        for i, (outcome, late) in enumerate(zip(outcomes, timed_out)):
            if late:
                if len(errors) < _MAX_ERRORS_KEPT:
                    errors.append(f"sample {i}: timed out after {self.timeout_s:g}s")
                continue
            if outcome is None or not outcome.ok:
                failed[i] = True
                if len(errors) < _MAX_ERRORS_KEPT:
                    errors.append(f"sample {i}: {outcome.error if outcome else 'no result'}")
                continue
            scores[i] = outcome.score
            for name, value in outcome.extras.items():
                if name not in extras:
                    extras[name] = torch.full((n,), math.nan, dtype=torch.float32)
                extras[name][i] = value
        return ScoreResult(scores, extras, failed, torch.tensor(timed_out, dtype=torch.bool).reshape(n), errors)


# ---------------------------------------------------------------------------------------------------------------
# process backend
# ---------------------------------------------------------------------------------------------------------------
class _Worker:
    def __init__(self, ctx, fn: Callable):
        self.proc, self.conn = spawn_child(worker_main, (fn,), "megappo-reward", ctx)
        self.ready = False
        self.started_at = time.monotonic()
        self.task: int | None = None  # index of the sample it is scoring
        self.deadline = math.inf

    def kill(self) -> None:
        # The worker leads its own process group (see worker_main); killing the group reaches its children too.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class _ProcessPool:
    """`num_workers` spawned workers, each scoring one sample at a time so a deadline maps to one sample."""

    def __init__(self, fn: Callable, num_workers: int):
        self._ctx = mp.get_context("spawn")  # never fork a trainer that holds threads, CUDA or process groups
        self._fn = fn
        self._workers = [_Worker(self._ctx, fn) for _ in range(num_workers)]
        self._finalizer = weakref.finalize(self, _ProcessPool._shutdown, self._workers)

    def run(self, tasks: list[tuple], timeout_s: float) -> tuple[list[Outcome | None], list[bool]]:
        outcomes: list[Outcome | None] = [None] * len(tasks)
        timed_out = [False] * len(tasks)
        pending = collections.deque(range(len(tasks)))
        remaining = len(tasks)
        while remaining:
            now = time.monotonic()
            for w in self._workers:
                if w.ready and w.task is None and pending:
                    i = pending.popleft()
                    try:
                        w.conn.send((i, tasks[i]))
                        w.task, w.deadline = i, now + timeout_s
                    except (BrokenPipeError, OSError):  # died while idle: replace it, the sample waits
                        pending.appendleft(i)
                        self._replace(w)
            deadline = min((w.deadline for w in self._workers if w.task is not None), default=now + 1.0)
            ready = wait_connections([w.conn for w in self._workers], timeout=max(0.0, deadline - now))
            for conn in ready:
                w = next(x for x in self._workers if x.conn is conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    w.proc.join(timeout=1)  # reap it, so the exit code below is known
                    if not w.ready:  # replacing it would only die the same way, forever
                        self.close()
                        raise RuntimeError(
                            f"a reward worker exited (code {w.proc.exitcode}) before it was ready; see its error "
                            "above. Workers are spawned: a script that starts training at import time must do so "
                            "under `if __name__ == '__main__':`"
                        )
                    if w.task is not None:
                        outcomes[w.task] = Outcome(False, 0.0, {}, f"reward worker died (exit code "
                                                                   f"{w.proc.exitcode}) while scoring this sample")
                        remaining -= 1
                    self._replace(w)
                    continue
                tag, payload = msg
                if tag == "ready":
                    w.ready = True
                elif tag == "load_error":
                    self.close()
                    raise RewardFunctionError(f"a reward worker could not load the reward function: {payload}")
                elif tag == w.task:
                    outcomes[w.task] = payload
                    w.task, w.deadline = None, math.inf
                    remaining -= 1
            now = time.monotonic()
            for w in list(self._workers):
                if w.task is not None and now >= w.deadline:
                    timed_out[w.task] = True
                    remaining -= 1
                    self._replace(w)
                elif not w.ready and now - w.started_at > _WORKER_START_TIMEOUT_S:
                    self.close()
                    raise RuntimeError(f"a reward worker did not start within {_WORKER_START_TIMEOUT_S:g}s")
        return outcomes, timed_out

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers[self._workers.index(worker)] = _Worker(self._ctx, self._fn)

    @staticmethod
    def _shutdown(workers: list[_Worker]) -> None:
        for w in workers:
            if w.task is None and w.ready:
                try:
                    w.conn.send(None)  # let an idle worker exit on its own
                except (BrokenPipeError, OSError):
                    pass
        for w in workers:
            w.proc.join(timeout=1)
            w.kill()

    def close(self) -> None:
        self._finalizer()


# ---------------------------------------------------------------------------------------------------------------
# Ray backend
# ---------------------------------------------------------------------------------------------------------------
def _noop() -> None:
    return None


def _restore_handlers(handlers: dict) -> None:
    import threading

    if threading.current_thread() is not threading.main_thread():
        return  # (ray.init installs none off the main thread)
    for sig, handler in handlers.items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)


class _RayRunner:
    def __init__(self, fn: Callable, num_workers: int, address: str | None):
        import ray

        self._owns_ray = False
        if not ray.is_initialized():
            # ray.init replaces the driver's SIGTERM handler (sys.exit), which would end the trainer at the first
            # preemption signal instead of letting it save: the trainer's handlers are put back
            handlers = {sig: signal.getsignal(sig) for sig in JOB_SIGNALS}
            try:
                if address is not None:
                    try:
                        ray.init(address=address)
                    except ConnectionError as e:
                        raise ConnectionError(
                            f"reward_model.ray_address={address!r}: {e} Start the cluster first (`ray start "
                            "--head`), or set reward_model.ray_address=null to start a local Ray here"
                        ) from e
                else:
                    # a Ray started here is the trainer's helper: its daemons and workers inherit the job signals
                    # blocked, and a preemption does not end them under the trainer's step
                    with job_signals_blocked():
                        ray.init(num_cpus=num_workers, include_dashboard=False)
                    self._owns_ray = True
            finally:
                _restore_handlers(handlers)
        self.num_workers = num_workers
        self._fn_ref = ray.put(fn)
        # max_retries=0: a cancelled or crashed sample is a failed sample, not something to run again.
        self._remote = ray.remote(num_cpus=1, max_retries=0)(evaluate)
        # Start the workers before the first deadline is measured: a cold Ray worker takes about a second.
        ray.get([ray.remote(num_cpus=1)(_noop).remote() for _ in range(num_workers)])

    def run(self, tasks: list[tuple], timeout_s: float) -> tuple[list[Outcome | None], list[bool]]:
        import ray

        outcomes: list[Outcome | None] = [None] * len(tasks)
        timed_out = [False] * len(tasks)
        in_flight: dict[Any, tuple[int, float]] = {}  # ref -> (sample index, deadline)
        next_task = 0
        while next_task < len(tasks) or in_flight:
            while next_task < len(tasks) and len(in_flight) < self.num_workers:
                ref = self._remote.remote(self._fn_ref, tasks[next_task])
                in_flight[ref] = (next_task, time.monotonic() + timeout_s)
                next_task += 1
            now = time.monotonic()
            wait_s = max(0.0, min(deadline for _, deadline in in_flight.values()) - now)
            done, _ = ray.wait(list(in_flight), num_returns=1, timeout=wait_s)
            for ref in done:
                i, _ = in_flight.pop(ref)
                try:
                    outcomes[i] = ray.get(ref)
                except Exception as e:  # the worker died (os._exit, segfault, OOM kill)
                    outcomes[i] = Outcome(False, 0.0, {}, f"Ray task failed: {type(e).__name__}: {e}"[:500])
            now = time.monotonic()
            for ref, (i, deadline) in list(in_flight.items()):
                if now >= deadline:
                    ray.cancel(ref, force=True)  # kills the worker process that runs it; Ray starts another
                    timed_out[i] = True
                    del in_flight[ref]
        return outcomes, timed_out

    def close(self) -> None:
        if self._owns_ray:
            import ray

            ray.shutdown()
            self._owns_ray = False
