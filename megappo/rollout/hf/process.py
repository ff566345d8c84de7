"""The in-process engine (`HFEngine`) run in a child process of its own, so generation overlaps the trainer's compute.

`HFProcessEngine` starts one spawned child (never forked: the trainer holds gloo process groups and threads) that
builds an `HFEngine` with its own torch thread budget (`threads`), and talks to it over one duplex pipe:

- `submit(prompts, params)` returns a `GenerationHandle` at once (`result(timeout)`, `done()`); `generate` is
  `submit(...).result()`. Completions are the in-process engine's, token for token (same seeds, same code). A
  vision-language prompt's images (`multi_modal`) cross the pipe as plain arrays (`vlm.to_pipe`).
- `abort()` ends the generation in flight and every one queued behind it: each returns at once with the tokens it
  has (finish_reason "abort"); requests queued but not started return empty ones.
- `update_weights(buckets, version=...)` stages each bucket in shared memory (`weight_staging.SharedStaging`, two
  slots: this side fills one while the child copies out of the other) and the child copies it into its model with
  `HFEngine.update_weights` (every parameter, or ValueError). `update_weights_from_disk` loads a HF directory.
- `pause()` holds generations submitted afterwards on this side until `resume()` (none is lost); the child runs
  requests one at a time in the order sent, so a weight update never lands in the middle of a generation.

The child's side is `child.py`; starting it, its parent-death rules and its errors' way back are
`megappo.platform.child_process`'s. The child dies with this process however it dies: the kernel's parent-death signal (SIGKILL, armed when the engine
is started from the main thread: it fires when the starting *thread* exits), a getppid() watch every 0.2 s (any
thread) and EOF on its pipe. It ignores the job-wide signals (SIGTERM, SIGINT, SIGUSR1, blocked from its start):
only `close()` stops it, with SIGKILL after a grace period. A child that died (OOM killer, crash) fails every call
in flight and every later one with a RuntimeError naming its exit code.
"""
from __future__ import annotations

import atexit
import itertools
import multiprocessing.util  # noqa: F401  (its exit hook is registered before ours: ours runs first)
import queue
import signal
import threading
import time
import weakref
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence, Union

from megappo.platform.child_process import spawn_child, unpickled_error
from megappo.rollout.base import RolloutEngine
from megappo.rollout.hf import vlm
from megappo.rollout.hf.child import aborted_completions, child_main
from megappo.rollout.sampling import Completion, SamplingParams, check_prompts

if TYPE_CHECKING:
    from megappo.data.multimodal import MultiModalInputs

CLOSE_GRACE_S = 10.0  # close(): how long the child may take to exit before SIGKILL


# ---------------------------------------------------------------------------------------------------------------
# parent side
# ---------------------------------------------------------------------------------------------------------------
def _died_starting(channel: Any) -> RuntimeError:
    return RuntimeError(f"the rollout engine's child process exited with code {channel.exit_code()} before it was "
                        "ready; see its output above")


class GenerationHandle(Future):
    """A generation submitted to `HFProcessEngine.submit` (a `concurrent.futures.Future`): `result(timeout=None)`
    waits for its completions (grouped by prompt, as `generate` returns them; TimeoutError after `timeout` s; the
    child's exception when it failed), `done()` says whether they are in. `started_at`/`finished_at`: when the child
    ran it, on time.monotonic()'s clock (one clock for every process on Linux); None until it is done."""

    def __init__(self) -> None:
        super().__init__()
        self.started_at: Optional[float] = None
        self.finished_at: Optional[float] = None


class _Channel:
    """The pipe to the child, its process, and the requests awaiting an answer; shared by the engine and the reader
    thread, never referring to the engine (an engine nobody holds is collected, and its finaliser stops the child)."""

    def __init__(self, conn, proc):
        self.conn, self.proc = conn, proc
        self.send_lock = threading.Lock()
        self.lock = threading.Lock()
        self.pending: dict[int, Future] = {}  # rid -> the future of its answer (GenerationHandle: a generation)
        self.acks: dict[int, "queue.Queue[int]"] = {}  # rid of a weight update -> its acknowledged bucket counts
        self.error: Optional[RuntimeError] = None  # set once the child is gone: every call raises it
        self.closing = False
        self.reader: Optional[threading.Thread] = None
        self.rids = itertools.count(1)
        self.last_rid = 0  # the last request sent: requests go out in increasing rid order

    def send_locked(self, msg: tuple) -> None:
        """Send `msg` (the caller holds send_lock); RuntimeError when the child is gone."""
        self.check()
        try:
            self.conn.send(msg)
        except (OSError, EOFError, ValueError):  # broken pipe, or the connection closed here
            self.child_gone()
            self.check()
            raise

    def send(self, msg: tuple) -> None:
        with self.send_lock:
            self.send_locked(msg)

    def request_locked(self, kind: str, args: tuple, fut: Future) -> int:
        """Send request `(kind, rid, *args)` whose answer goes to `fut` (caller holds send_lock); its rid."""
        self.check()
        rid = next(self.rids)
        with self.lock:
            self.pending[rid] = fut
        self.send_locked((kind, rid, *args))
        self.last_rid = rid
        return rid

    def request(self, kind: str, *args: Any) -> tuple[int, Future]:
        fut: Future = Future()
        with self.send_lock:
            return self.request_locked(kind, args, fut), fut

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def exit_code(self) -> Optional[int]:
        self.proc.join(timeout=5)
        return self.proc.exitcode

    def child_gone(self) -> None:
        """Fail every request awaiting an answer, and every later call."""
        closed = self.closing
        code = None if closed else self.exit_code()
        with self.lock:
            if self.error is None:
                if closed:
                    self.error = RuntimeError("the rollout engine is closed")
                else:
                    how = f"exit code {code}"
                    if code is not None and code < 0:
                        try:
                            how += f" ({signal.Signals(-code).name}; SIGKILL is often the OOM killer)"
                        except ValueError:
                            pass
                    self.error = RuntimeError(f"the rollout engine's child process (pid {self.proc.pid}) died "
                                              f"with {how}; see its output above")
            pending, self.pending = self.pending, {}
            for q in self.acks.values():
                q.put(-1)
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(self.error)

    def read(self) -> None:
        """The reader thread: answers to the waiting requests, until the child's end of the pipe closes."""
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                self.child_gone()
                return
            kind, rid = msg[0], msg[1]
            if kind == "ack":
                with self.lock:
                    q = self.acks.get(rid)
                if q is not None:
                    q.put(msg[2])
                continue
            with self.lock:
                fut = self.pending.pop(rid, None)
            if fut is None:
                continue
            if isinstance(fut, GenerationHandle) and kind == "result":
                fut.started_at, fut.finished_at = msg[3]
            if kind == "result":
                fut.set_result(msg[2])
            else:
                fut.set_exception(_child_error(msg[2]))

    def shutdown(self, grace: float = CLOSE_GRACE_S) -> None:
        """Abort what runs, ask the child to exit, SIGKILL it after `grace` seconds; idempotent."""
        if self.proc.exitcode is None and self.error is None:
            try:
                with self.send_lock:
                    self.closing = True
                    self.send_locked(("abort", self.last_rid))
                    self.send_locked(("close",))
            except Exception:
                pass
            self.proc.join(timeout=grace)
        self.closing = True
        if self.proc.exitcode is None:
            self.proc.kill()
            self.proc.join(timeout=5)
        if self.reader is not None and self.reader is not threading.current_thread():
            self.reader.join(timeout=5)  # the answers the child sent before it exited
        self.child_gone()
        try:
            self.conn.close()
        except OSError:
            pass


def _child_error(payload: tuple[Optional[bytes], str]) -> BaseException:
    return unpickled_error(payload, failed="the rollout engine's child process failed",
                           where="in the engine's child process")


_LIVE: "weakref.WeakSet[_Channel]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """At exit, before multiprocessing's own exit hook (which would wait forever for a child ignoring SIGTERM)."""
    for channel in list(_LIVE):
        channel.shutdown(grace=2.0)


class HFProcessEngine(RolloutEngine):
    """`HFEngine(model_path, **kwargs)` in a spawned child process with `threads` torch threads (see the module
    docstring). kwargs: HFEngine's (dtype, device, max_num_seqs, seed, trust_remote_code). start_timeout: seconds
    the child may take to load the model."""

    modes = ("tensor",)  # the transports of load_weights ("disk": update_weights_from_disk)

    def __init__(self, model_path: str, *, threads: int = 1, start_timeout: float = 600.0, **kwargs: Any):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if "device" in kwargs:
            kwargs["device"] = str(kwargs["device"])
        main_thread = threading.current_thread() is threading.main_thread()
        proc, conn = spawn_child(child_main, (main_thread, threads, str(model_path), kwargs), "megappo-hf-engine")
        self._channel = channel = _Channel(conn, proc)
        _LIVE.add(channel)
        self._finalizer = weakref.finalize(self, channel.shutdown)
        self.threads = threads
        self.pid = proc.pid
        try:
            self.weight_version = self._wait_ready(start_timeout)
        except BaseException:
            self.close()
            raise
        channel.reader = threading.Thread(target=channel.read, name="megappo-engine-read", daemon=True)
        channel.reader.start()
        self._paused = False
        self._held: list[tuple[GenerationHandle, tuple]] = []  # submitted while paused, sent on resume
        self._update_lock = threading.Lock()
        self._staging = None

    def _wait_ready(self, timeout: float) -> int:
        channel, deadline = self._channel, time.monotonic() + timeout
        while not channel.conn.poll(0.2):
            if not channel.proc.is_alive():
                raise _died_starting(channel)
            if time.monotonic() > deadline:
                raise RuntimeError(f"the rollout engine's child process was not ready after {timeout:g} s")
        try:
            kind, payload = channel.conn.recv()
        except (EOFError, OSError):
            raise _died_starting(channel) from None
        if kind == "fatal":
            raise _child_error(payload)
        return payload

    # -- requests ----------------------------------------------------------------------------------------------
    def submit(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, prompt_offset: int = 0,
               multi_modal: Optional[Sequence[Optional[MultiModalInputs]]] = None) -> GenerationHandle:
        """Start generating (see `generate`) and return at once; `handle.result()` waits for the completions."""
        check_prompts(prompts)
        channel = self._channel
        handle = GenerationHandle()
        images = vlm.to_pipe(multi_modal, len(prompts))
        args = ([list(map(int, p)) for p in prompts], params, int(prompt_offset), images)
        with channel.send_lock:
            if self._paused:
                channel.check()
                self._held.append((handle, args))
            else:
                channel.request_locked("generate", args, handle)
        return handle

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, prompt_offset: int = 0,
                 multi_modal: Optional[Sequence[Optional[MultiModalInputs]]] = None) -> list[list[Completion]]:
        """`params.n` completions per prompt, grouped by prompt, as `HFEngine.generate` gives them (same seeds);
        waits for them (through a `pause()` too, until `resume()`)."""
        return self.submit(prompts, params, prompt_offset=prompt_offset, multi_modal=multi_modal).result()

    def abort(self) -> None:
        """End every generation submitted so far, at once: the one running returns the tokens it has, the ones
        queued or held by `pause()` return empty (finish_reason "abort"). Does not wait for them."""
        channel = self._channel
        with channel.send_lock:
            held, self._held = self._held, []
            upto = channel.last_rid
        for handle, (prompts, params, *_) in held:
            handle.set_result(aborted_completions(len(prompts), params.n, self.weight_version))
        if upto and channel.error is None:
            try:
                channel.send(("abort", upto))
            except RuntimeError:  # the child is gone: what was in flight has failed already
                pass

    def pause(self) -> None:
        """Hold generations submitted from now on here until `resume()`; those already sent finish first (the child
        runs requests in order, so a weight update sent now waits for them)."""
        with self._channel.send_lock:
            self._paused = True

    def resume(self) -> None:
        """Send the generations held since `pause()`, in the order they were submitted."""
        channel = self._channel
        with channel.send_lock:
            self._paused = False
            held, self._held = self._held, []
            for i, (handle, args) in enumerate(held):
                try:
                    channel.request_locked("generate", args, handle)
                except RuntimeError as e:  # the child is gone: the held ones fail too
                    for h, _ in held[i:]:
                        if not h.done():
                            h.set_exception(e)
                    raise

    # -- weights -----------------------------------------------------------------------------------------------
    def update_weights(self, buckets: Iterable[Union[list, tuple]], *, version: int, partial: bool = False) -> int:
        """Load checkpoint-named tensors (buckets of (name, tensor) pairs, or pairs) into the child's model as
        `version` (every parameter, or the child's ValueError); returns it. Each bucket is copied once into a shared
        staging buffer here and once into the parameters there; the caller may reuse its tensors on return."""
        from megappo.rollout.serving.weight_staging import SharedStaging

        channel = self._channel
        with self._update_lock:
            if self._staging is None:
                self._staging = SharedStaging(slots=2)
            acks: "queue.Queue[int]" = queue.Queue()
            fut: Future = Future()
            with channel.send_lock:
                rid = channel.request_locked("update_begin", (int(version), bool(partial)), fut)
                with channel.lock:
                    channel.acks[rid] = acks
            acked, sent = 0, 0
            try:
                for item in buckets:
                    bucket = [item] if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) \
                        else list(item)
                    while sent - acked >= 2:  # both slots in use: wait for the child to copy the older out
                        if fut.done():
                            return fut.result()  # raises the child's error
                        try:
                            got = acks.get(timeout=0.2)
                        except queue.Empty:
                            channel.check()
                            continue
                        if got < 0:
                            channel.check()
                        acked = max(acked, got)
                    staged = self._staging.stage(sent % 2, bucket)
                    channel.send(("bucket", rid, SharedStaging.handles(staged)))
                    sent += 1
            except BaseException:
                try:  # the child drops the update (if it has not already failed) and answers with an error
                    channel.send(("update_cancel", rid))
                    fut.exception()
                except RuntimeError:
                    pass
                raise
            finally:
                with channel.lock:
                    channel.acks.pop(rid, None)
            channel.send(("update_end", rid))
            self.weight_version = fut.result()
            return self.weight_version

    def load_weights(self, buckets: Iterable[list], *, version: int, mode: str = "tensor",
                     partial: bool = False) -> int:
        """The trainer's weight sync (rollout.weight_sync=tensor): `update_weights`."""
        if mode not in self.modes:
            raise ValueError(f"{type(self).__name__} loads weights in modes {self.modes}, not {mode!r}")
        return self.update_weights(buckets, version=version, partial=partial)

    def update_weights_from_disk(self, model_path: str, *, version: int) -> int:
        """Load a Hugging Face directory of the same architecture (safetensors) into the child's model."""
        with self._update_lock:
            self.weight_version = self._channel.request("update_from_disk", str(model_path), int(version))[1].result()
            return self.weight_version

    def check_version(self, version: int) -> None:
        if self.weight_version != version:
            raise RuntimeError(f"the rollout engine holds weights version {self.weight_version}, not {version}")

    def prompt_log_probs(self, token_ids: Sequence[int], *, multi_modal: Optional[MultiModalInputs] = None
                         ) -> list[list[float]]:
        """[log p(token_ids[k] | token_ids[:k]) for k >= 1], computed in the child (after the requests sent before)."""
        images = vlm.one_to_pipe(multi_modal)
        return self._channel.request("prompt_log_probs", [int(t) for t in token_ids], images)[1].result()

    def sequence_log_probs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """`HFEngine.sequence_log_probs` in the child: one request, batched forwards there."""
        return self._channel.request("sequence_log_probs", [[int(t) for t in s] for s in sequences])[1].result()

    # -- life --------------------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._channel.error is None and self._channel.proc.is_alive()

    def close(self) -> None:
        """Abort what runs, stop the child (SIGKILL after a grace period) and wait for it; idempotent. Requests
        still waiting fail with RuntimeError."""
        self._finalizer()
        super().close()
        if getattr(self, "_staging", None) is not None:
            self._staging.close()
            self._staging = None

    def __enter__(self) -> "HFProcessEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
