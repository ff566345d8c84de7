"""The child process of `HFProcessEngine` (`process.py`): an `HFEngine` that answers the parent's requests.

Requests arrive on one duplex pipe as `(kind, rid, *args)`; a receiving thread acts on "abort" at once and queues
everything else, which the main thread runs one at a time, in the order sent, each by its handler method
(`EngineChild.handlers`). An answer is ("result", rid, value, (started, finished)) or ("error", rid, pickled error). A weight
update is "update_begin", its buckets ("bucket", rid, handles; each acknowledged with ("ack", rid, count) once the
next is asked for, so its staging slot may be refilled) and "update_end" or "update_cancel".
"""
from __future__ import annotations

import os
import pickle
import queue
import sys
import threading
import time
from typing import Any, Iterator, Optional

import torch

from megappo.platform.child_process import enter_child, pickled_error
from megappo.rollout.hf.engine import HFEngine
from megappo.rollout.hf import vlm
from megappo.rollout.sampling import Completion

_UPDATE_MESSAGES = ("bucket", "update_end", "update_cancel")


def aborted_completions(num_prompts: int, n: int, version: int) -> list[list[Completion]]:
    """The completions of a request aborted before it started: empty, finish_reason "abort"."""
    return [[Completion(prompt_index=i, output_ids=[], log_probs=[], finish_reason="abort", weight_version=version)
             for _ in range(n)] for i in range(num_prompts)]


class _ChildEngine(HFEngine):
    """HFEngine that re-checks, at each forward batch, whether its request was aborted: an abort that came between
    the request's start and `generate`'s clearing of the abort flag would otherwise be lost."""

    def __init__(self, *args, aborted, **kwargs):
        super().__init__(*args, **kwargs)
        self._request_aborted = aborted

    def _generate_batch(self, rows, params, seeds, images=None):
        if self._request_aborted():
            self.abort()
        return super()._generate_batch(rows, params, seeds, images)


class _Answered(Exception):
    """A handler that sent its own answer (a failed weight update answers before draining its buckets)."""


class EngineChild:
    """The request loop around one engine; `handlers[kind](rid, *args)` answers request `kind`."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self.engine: Optional[HFEngine] = None
        self.lock = threading.Lock()
        self.aborted_upto = 0  # request ids: every one <= aborted_upto is aborted
        self.running: Optional[int] = None
        self.inbox: "queue.Queue[tuple]" = queue.Queue()
        self.deferred: list[tuple] = []  # requests that came during a weight update's stream, run after it
        self.handlers = {"close": self.on_close, "generate": self.on_generate, "update_begin": self.on_update_begin,
                         "update_from_disk": self.on_update_from_disk, "prompt_log_probs": self.on_prompt_log_probs,
                         "sequence_log_probs": self.on_sequence_log_probs}

    def request_aborted(self) -> bool:
        with self.lock:
            return self.running is not None and self.running <= self.aborted_upto

    def receive(self) -> None:
        """The receiving thread: aborts act at once; everything else runs on the main thread, in order."""
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):  # the parent is gone (close() sends "close" and waits first)
                os._exit(1)
            if msg[0] != "abort":
                self.inbox.put(msg)
                continue
            with self.lock:
                self.aborted_upto = max(self.aborted_upto, msg[1])
                if self.running is not None and self.running <= self.aborted_upto:
                    self.engine.abort()

    def serve(self) -> None:
        threading.Thread(target=self.receive, name="megappo-engine-receive", daemon=True).start()
        while True:
            msg = self.deferred.pop(0) if self.deferred else self.inbox.get()
            kind, rid = msg[0], msg[1] if len(msg) > 1 else None
            if kind in _UPDATE_MESSAGES:  # of an update already answered
                if kind == "bucket":
                    pickle.loads(msg[2])  # releases its shared-memory handle
                continue
            started = time.monotonic()
            try:
                handler = self.handlers.get(kind)
                if handler is None:
                    raise ValueError(f"unknown request {kind!r}")
                result = handler(rid, *msg[2:])
            except _Answered:
                continue
            except Exception as e:
                self.conn.send(("error", rid, pickled_error(e)))
            else:
                self.conn.send(("result", rid, result, (started, time.monotonic())))

    # -- handlers ------------------------------------------------------------------------------------------------
    def on_close(self, rid: None) -> None:
        """Leave without the interpreter's slow teardown (~1 s), but release what multiprocessing registered in this
        process (a semaphore of the child's start-up), which its resource tracker would otherwise report as leaked
        when the trainer exits."""
        import multiprocessing.util

        multiprocessing.util._run_finalizers(0)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    def on_generate(self, rid: int, prompts, params, offset: int, images) -> list[list[Completion]]:
        with self.lock:
            skip = rid <= self.aborted_upto
            self.running = None if skip else rid
        try:
            if skip:
                return aborted_completions(len(prompts), params.n, self.engine.weight_version)
            return self.engine.generate(prompts, params, prompt_offset=offset, multi_modal=vlm.from_pipe(images))
        finally:
            with self.lock:
                self.running = None

    def on_update_begin(self, rid: int, version: int, partial: bool = False) -> int:
        ended: list = []
        try:
            return self.engine.update_weights(self._update_stream(rid, ended), version=version,
                                              complete=not partial)
        except Exception as e:  # answer at once (the trainer stops streaming), then drop the rest
            self.conn.send(("error", rid, pickled_error(e)))
            if not ended:
                self._drain_update(rid)
            raise _Answered from e

    def on_update_from_disk(self, rid: int, model_path: str, version: int) -> int:
        return self.engine.update_weights_from_disk(model_path, version=version)

    def on_prompt_log_probs(self, rid: int, token_ids, images) -> list[list[float]]:
        return self.engine.prompt_log_probs(token_ids, multi_modal=vlm.one_from_pipe(images))

    def on_sequence_log_probs(self, rid: int, sequences) -> list[list[float]]:
        return self.engine.sequence_log_probs(sequences)

    # -- a weight update's stream ----------------------------------------------------------------------------------
    def _update_stream(self, rid: int, ended: list) -> Iterator[Any]:
        """The buckets of weight update `rid` as they arrive; each is acknowledged once the next one is asked for
        (its slot may then be refilled)."""
        count = 0
        while True:
            msg = self.inbox.get()
            if msg[0] == "bucket" and msg[1] == rid:
                staged = pickle.loads(msg[2])
                yield staged
                del staged
                count += 1
                self.conn.send(("ack", rid, count))
            elif msg[0] == "update_end" and msg[1] == rid:
                ended.append(True)
                return
            elif msg[0] == "update_cancel" and msg[1] == rid:
                ended.append(True)
                raise RuntimeError("the weight update was cancelled by the trainer (its export failed)")
            else:
                self.deferred.append(msg)

    def _drain_update(self, rid: int) -> None:
        """After a failed update: consume (and release) the buckets still on their way, up to its end."""
        while True:
            msg = self.inbox.get()
            if msg[0] == "bucket" and msg[1] == rid:
                pickle.loads(msg[2])
            elif msg[0] in ("update_end", "update_cancel") and msg[1] == rid:
                return
            else:
                self.deferred.append(msg)


def child_main(conn, parent_pid: int, arm_pdeathsig: bool, threads: int, model_path: str, kwargs: dict) -> None:
    """The child's entry (`spawn_child`'s target): die with the parent, build the engine, answer requests."""
    enter_child(parent_pid, arm_pdeathsig=arm_pdeathsig, watch_parent=True)
    torch.set_num_threads(threads)
    child = EngineChild(conn)
    try:
        child.engine = _ChildEngine(model_path, aborted=child.request_aborted, **kwargs)
    except BaseException as e:
        conn.send(("fatal", pickled_error(e)))
        return
    conn.send(("ready", child.engine.weight_version))
    child.serve()
