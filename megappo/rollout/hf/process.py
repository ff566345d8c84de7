"""The in-process engine (`HFEngine`) run in a child process of its own, so generation overlaps the trainer's compute.

`HFProcessEngine` starts one spawned child (never forked: the trainer holds gloo process groups and threads) that
builds an `HFEngine` with its own torch thread budget (`threads`), and talks to it over one duplex pipe:

- `submit(prompts, params)` returns a `GenerationHandle` at once (`result(timeout)`, `done()`); `generate` is
  `submit(...).result()`. Completions are the in-process engine's, token for token (same seeds, same code). A
  vision-language prompt's images (`multi_modal`) cross the pipe as plain arrays (`_pack_images`).
- `abort()` ends the generation in flight and every one queued behind it: each returns at once with the tokens it
  has (finish_reason "abort"); requests queued but not started return empty ones.
- `update_weights(buckets, version=...)` stages each bucket in shared memory (`weight_staging.SharedStaging`, two
  slots: this side fills one while the child copies out of the other) and the child copies it into its model with
  `HFEngine.update_weights` (every parameter, or ValueError). `update_weights_from_disk` loads a HF directory.
- `pause()` holds generations submitted afterwards on this side until `resume()` (none is lost); the child runs
  requests one at a time in the order sent, so a weight update never lands in the middle of a generation.

The child dies with this process however it dies: the kernel's parent-death signal (SIGKILL, armed when the engine
is started from the main thread: it fires when the starting *thread* exits), a getppid() watch every 0.2 s (any
thread) and EOF on its pipe. It ignores the job-wide signals (SIGTERM, SIGINT, SIGUSR1, blocked from its start):
only `close()` stops it, with SIGKILL after a grace period. A child that died (OOM killer, crash) fails every call
in flight and every later one with a RuntimeError naming its exit code.
"""
from __future__ import annotations

import atexit
import itertools
import multiprocessing
import multiprocessing.util  # noqa: F401  (its exit hook is registered before ours: ours runs first)
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
import weakref
from concurrent.futures import Future
from typing import Any, Iterable, Optional, Sequence, Union

import torch

from megappo.data.multimodal import MultiModalInputs
from megappo.rollout.base import LocalDeployment, RolloutEngine
from megappo.rollout.hf.engine import HFEngine
from megappo.rollout.sampling import Completion, SamplingParams

PARENT_POLL_S = 0.2  # the child's getppid() watch
CLOSE_GRACE_S = 10.0  # close(): how long the child may take to exit before SIGKILL


def _aborted(num_prompts: int, n: int, version: int) -> list[list[Completion]]:
    """The completions of a request aborted before it started: empty, finish_reason "abort"."""
    return [[Completion(prompt_index=i, output_ids=[], log_probs=[], finish_reason="abort", weight_version=version)
             for _ in range(n)] for i in range(num_prompts)]


def _pack_images(multi_modal: Optional[Sequence[Optional[MultiModalInputs]]]) -> Optional[list]:
    """Prompts' images as numpy arrays: pickled through the pipe by value, where tensors would go through torch's
    shared-memory file descriptors (one per tensor, each a resource the child must take before the parent moves
    on). The PIL images stay here: the child's engine uses the processed pixels."""
    if multi_modal is None:
        return None
    return [None if m is None else (m.pixel_values.detach().cpu().numpy(), m.image_grid_thw.cpu().numpy())
            for m in multi_modal]


def _unpack_images(packed: Optional[list]) -> Optional[list[Optional[MultiModalInputs]]]:
    if packed is None:
        return None
    return [None if m is None else MultiModalInputs(torch.from_numpy(m[0]), torch.from_numpy(m[1])) for m in packed]


def _check_prompts(prompts: Sequence[Sequence[int]]) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")


class _ChildTraceback(Exception):
    """The traceback of an exception raised in the engine's child process (the __cause__ of the re-raised one)."""


# ---------------------------------------------------------------------------------------------------------------
# child side
# ---------------------------------------------------------------------------------------------------------------
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


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


def _child_main(conn, parent_pid: int, arm_pdeathsig: bool, threads: int, model_path: str, kwargs: dict) -> None:
    from megappo.platform.child_reaper import die_with_parent
    from megappo.platform.job_signals import ignore_job_signals

    ignore_job_signals()  # started with them blocked: a pending one is discarded here
    if arm_pdeathsig:
        die_with_parent(parent_pid)  # exits now if the parent is already gone
    elif os.getppid() != parent_pid:
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="megappo-parent-watch", daemon=True).start()
    torch.set_num_threads(threads)

    lock = threading.Lock()
    state = {"aborted_upto": 0, "running": None}  # request ids: every one <= aborted_upto is aborted

    def request_aborted() -> bool:
        with lock:
            return state["running"] is not None and state["running"] <= state["aborted_upto"]

    try:
        engine = _ChildEngine(model_path, aborted=request_aborted, **kwargs)
    except BaseException as e:
        conn.send(("fatal", _pickled_error(e)))
        return
    conn.send(("ready", engine.weight_version))

    inbox: "queue.Queue[tuple]" = queue.Queue()

    def receive() -> None:  # aborts act at once; everything else runs on the main thread, in order
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the parent is gone (close() sends "close" and waits first)
                os._exit(1)
            if msg[0] == "abort":
                with lock:
                    state["aborted_upto"] = max(state["aborted_upto"], msg[1])
                    if state["running"] is not None and state["running"] <= state["aborted_upto"]:
                        engine.abort()
            else:
                inbox.put(msg)

    threading.Thread(target=receive, name="megappo-engine-receive", daemon=True).start()
    deferred: list[tuple] = []  # requests that came during a weight update's stream, run after it

    def next_msg() -> tuple:
        return deferred.pop(0) if deferred else inbox.get()

    def update_stream(rid: int, ended: list):
        """The buckets of weight update `rid` as they arrive; each is acknowledged once the next one is asked for
        (its slot may then be refilled)."""
        count = 0
        while True:
            msg = inbox.get()
            if msg[0] == "bucket" and msg[1] == rid:
                staged = pickle.loads(msg[2])
                yield staged
                del staged
                count += 1
                conn.send(("ack", rid, count))
            elif msg[0] == "update_end" and msg[1] == rid:
                ended.append(True)
                return
            elif msg[0] == "update_cancel" and msg[1] == rid:
                ended.append(True)
                raise RuntimeError("the weight update was cancelled by the trainer (its export failed)")
            else:
                deferred.append(msg)

    def drain_update(rid: int) -> None:
        """After a failed update: consume (and release) the buckets still on their way, up to its end."""
        while True:
            msg = inbox.get()
            if msg[0] == "bucket" and msg[1] == rid:
                pickle.loads(msg[2])
            elif msg[0] in ("update_end", "update_cancel") and msg[1] == rid:
                return
            else:
                deferred.append(msg)

    while True:
        msg = next_msg()
        kind, rid = msg[0], msg[1] if len(msg) > 1 else None
        if kind == "close":  # leave without the interpreter's slow teardown (~1 s), but release what
            # multiprocessing registered in this process (a semaphore of the child's start-up), which its resource
            # tracker would otherwise report as leaked when the trainer exits
            import multiprocessing.util

            multiprocessing.util._run_finalizers(0)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        if kind in ("bucket", "update_end", "update_cancel"):  # of an update already answered
            if kind == "bucket":
                pickle.loads(msg[2])  # releases its shared-memory handle
            continue
        started = time.monotonic()
        try:
            if kind == "generate":
                prompts, params, offset, images = msg[2:]
                with lock:
                    skip = rid <= state["aborted_upto"]
                    state["running"] = None if skip else rid
                try:
                    if skip:
                        result = _aborted(len(prompts), params.n, engine.weight_version)
                    else:
                        result = engine.generate(prompts, params, prompt_offset=offset,
                                                 multi_modal=_unpack_images(images))
                finally:
                    with lock:
                        state["running"] = None
            elif kind == "update_begin":
                ended: list = []
                try:
                    result = engine.update_weights(update_stream(rid, ended), version=msg[2],
                                                   complete=not (len(msg) > 3 and msg[3]))
                except Exception as e:  # answer at once (the trainer stops streaming), then drop the rest
                    conn.send(("error", rid, _pickled_error(e)))
                    if not ended:
                        drain_update(rid)
                    continue
            elif kind == "update_from_disk":
                result = engine.update_weights_from_disk(msg[2], version=msg[3])
            elif kind == "prompt_log_probs":
                images = _unpack_images(msg[3])
                result = engine.prompt_log_probs(msg[2], multi_modal=images[0] if images else None)
            else:
                raise ValueError(f"unknown request {kind!r}")
        except Exception as e:
            conn.send(("error", rid, _pickled_error(e)))
        else:
            conn.send(("result", rid, result, (started, time.monotonic())))


def _pickled_error(e: BaseException) -> tuple[Optional[bytes], str]:
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    try:
        return pickle.dumps(e), tb
    except Exception:
        return None, tb


def _unpickled_error(payload: tuple[Optional[bytes], str]) -> BaseException:
    blob, tb = payload
    err: Optional[BaseException] = None
    if blob is not None:
        try:
            err = pickle.loads(blob)
        except Exception:
            err = None
    if not isinstance(err, BaseException):
        err = RuntimeError(f"the rollout engine's child process failed:\n{tb}")
    err.__cause__ = _ChildTraceback(f"\n(in the engine's child process)\n{tb}")
    return err


# ---------------------------------------------------------------------------------------------------------------
# parent side
# ---------------------------------------------------------------------------------------------------------------
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
                fut.set_exception(_unpickled_error(msg[2]))

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
        from megappo.platform.job_signals import job_signals_blocked

        ctx = multiprocessing.get_context("spawn")
        conn, child_conn = ctx.Pipe(duplex=True)
        main_thread = threading.current_thread() is threading.main_thread()
        proc = ctx.Process(target=_child_main, name="megappo-hf-engine", daemon=True,
                           args=(child_conn, os.getpid(), main_thread, threads, str(model_path), kwargs))
        with job_signals_blocked():  # until the child ignores them
            proc.start()
        child_conn.close()  # so this end reads EOF when the child dies
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
                raise RuntimeError(f"the rollout engine's child process exited with code {channel.exit_code()} "
                                   f"before it was ready; see its output above")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the rollout engine's child process was not ready after {timeout:g} s")
        try:
            kind, payload = channel.conn.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"the rollout engine's child process exited with code {channel.exit_code()} before "
                               f"it was ready; see its output above") from None
        if kind == "fatal":
            raise _unpickled_error(payload)
        return payload

    # -- requests ----------------------------------------------------------------------------------------------
    def submit(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, prompt_offset: int = 0,
               multi_modal: Optional[Sequence[Optional[MultiModalInputs]]] = None) -> GenerationHandle:
        """Start generating (see `generate`) and return at once; `handle.result()` waits for the completions."""
        _check_prompts(prompts)
        channel = self._channel
        handle = GenerationHandle()
        if multi_modal is not None and len(multi_modal) != len(prompts):
            raise ValueError(f"multi_modal has {len(multi_modal)} entries for {len(prompts)} prompts")
        args = ([list(map(int, p)) for p in prompts], params, int(prompt_offset), _pack_images(multi_modal))
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
            handle.set_result(_aborted(len(prompts), params.n, self.weight_version))
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
        from megappo.rollout.sglang.weight_staging import SharedStaging

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
        images = _pack_images([multi_modal]) if multi_modal is not None else None
        return self._channel.request("prompt_log_probs", [int(t) for t in token_ids], images)[1].result()

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


def deploy(cfg, ps, platform) -> LocalDeployment:
    """One HFProcessEngine per data-parallel replica, on its first rank, loaded from the actor's Hugging Face
    directory, with `rollout.engine_kwargs.threads` torch threads (default 1) in its child process."""
    import torch.distributed as dist

    arr = cfg.actor_rollout_ref
    kw = dict(arr.rollout.engine_kwargs or {})
    unknown = sorted(set(kw) - {"threads"})
    if unknown:
        raise ValueError(f"actor_rollout_ref.rollout.engine_kwargs: {unknown} are not arguments of the hf engine "
                         f"in its own process (actor_rollout_ref.hybrid_engine=false; it takes: threads)")
    return LocalDeployment(
        dist.get_rank(ps.mp_group) == 0,
        lambda: HFProcessEngine(arr.model.path, threads=int(kw.get("threads", 1)), dtype=platform.dtype,
                                device=platform.device, max_num_seqs=arr.rollout.max_num_seqs, seed=cfg.data.seed,
                                trust_remote_code=arr.model.trust_remote_code))
