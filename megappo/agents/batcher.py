"""Concurrent calls gathered into engine requests: one thread calls `engine.generate` for every waiting call of the
same sampling parameters (seeds and token limits aside) at once, since the in-process engine is much faster batched.

A call waits at most `wait_s` for others once it is first in line (none when `max_batch` calls wait already), and
longer only while the engine serves an earlier batch. Each call carries its own seed (`SamplingParams.row_seeds`),
so what it draws does not depend on the batch it lands in (up to float summation order in the forward pass); the
batch generates up to its largest `max_new_tokens` and each call's completion is cut to its own (a row's tokens
before its limit are the same either way).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Optional

from megappo.rollout.base import RolloutEngine
from megappo.rollout.sampling import Completion, SamplingParams


class Closed(RuntimeError):
    """The endpoint stopped before the call was answered."""


@dataclass(eq=False)  # hashed by identity: the endpoint keeps a set of calls in flight
class Pending:
    """One call waiting for its completion."""

    prompt: list[int]
    params: SamplingParams  # row_seeds holds this call's one seed
    queued_at: float = field(default_factory=time.perf_counter)
    started_at: float = 0.0
    busy_s: float = 0.0  # waited while the engine served earlier batches (the rest of the wait is the gathering)
    engine_s: float = 0.0
    completion: Optional[Completion] = None
    error: Optional[BaseException] = None
    done: threading.Event = field(default_factory=threading.Event)

    def finish(self, completion: Optional[Completion] = None, error: Optional[BaseException] = None) -> None:
        if not self.done.is_set():  # the first answer stands (a close may have failed it already)
            self.completion, self.error = completion, error
            self.done.set()

    def result(self, timeout: float) -> Completion:
        if not self.done.wait(timeout):
            raise TimeoutError(f"no completion within {timeout:.0f}s")
        if self.error is not None:
            raise self.error
        return self.completion


class Batcher:
    """Gathers `Pending` calls and serves them in batches from one thread (see the module docstring)."""

    def __init__(self, engine: RolloutEngine, *, wait_s: float = 0.002, max_batch: int = 64):
        self.engine, self.wait_s, self.max_batch = engine, wait_s, max_batch
        self._queue: list[Pending] = []
        self._cond = threading.Condition()
        self._closed = False
        self.batches = 0  # engine requests made
        self._thread = threading.Thread(target=self._loop, name="megappo-agent-batcher", daemon=True)
        self._thread.start()

    def submit(self, prompt: list[int], params: SamplingParams, seed: int) -> Pending:
        call = Pending(list(prompt), replace(params, n=1, seed=None, row_seeds=(seed,)))
        with self._cond:
            if self._closed:
                raise Closed("the endpoint is closed")
            self._queue.append(call)
            self._cond.notify_all()
        return call

    def fail_all(self, error: BaseException) -> None:
        """Answer every waiting call with `error` (the batch in flight is answered when it returns)."""
        with self._cond:
            queued, self._queue = self._queue, []
        for call in queued:
            call.finish(error=error)

    def close(self, wait_s: float = 1.0) -> None:
        """Stop taking calls and fail those waiting. A batch in the engine is not waited for past `wait_s` (the
        thread ends once the engine returns it; its answers are dropped)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.fail_all(Closed("the endpoint is closed"))
        self._thread.join(timeout=wait_s)

    def _take(self) -> Optional[list[Pending]]:
        """The next batch: the first waiting call and those of the same parameters, after the gathering window."""
        free = time.perf_counter()  # the engine is free from here
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            deadline = self._queue[0].queued_at + self.wait_s
            while len(self._queue) < self.max_batch and not self._closed:
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                self._cond.wait(left)
            if not self._queue:
                return None if self._closed else []
            key = _key(self._queue[0].params)
            batch = [c for c in self._queue if _key(c.params) == key][:self.max_batch]
            taken = {id(c) for c in batch}
            self._queue = [c for c in self._queue if id(c) not in taken]
        for c in batch:
            c.busy_s = max(free - c.queued_at, 0.0)
        return batch

    def _loop(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            if batch:
                self._serve(batch)

    def _serve(self, batch: list[Pending]) -> None:
        start = time.perf_counter()
        params = replace(batch[0].params, row_seeds=tuple(c.params.row_seeds[0] for c in batch),
                         max_new_tokens=max(c.params.max_new_tokens for c in batch))
        try:
            groups = self.engine.generate([c.prompt for c in batch], params)
        except BaseException as e:  # the engine's failure is every call's answer; the thread goes on
            for c in batch:
                c.started_at, c.engine_s = start, time.perf_counter() - start
                c.finish(error=e)
            return
        elapsed = time.perf_counter() - start
        self.batches += 1
        for c, group in zip(batch, groups):
            c.started_at, c.engine_s = start, elapsed
            c.finish(_cut(group[0], c.params.max_new_tokens))


def _cut(c: Completion, limit: int) -> Completion:
    if len(c.output_ids) <= limit:
        return c
    return replace(c, output_ids=c.output_ids[:limit], log_probs=c.log_probs[:limit], finish_reason="length")


def _key(params: SamplingParams) -> SamplingParams:
    return replace(params, row_seeds=None, max_new_tokens=0)
