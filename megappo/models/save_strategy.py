"""megatron's torch_dist save, with no process that can outlive the run.

megatron-core 0.16's save strategy (`TorchDistSaveShardedStrategy`) writes through `FileSystemWriterAsync`, built for
saves that finish in a background process. Two of its helpers break megappo's rule that nothing a run starts outlives
it (`megappo.platform.child_reaper`):

- its results queue is `multiprocessing.get_context("spawn").Manager().Queue()`, made at the first save and kept for
  the life of the process: a spawned manager server (~270 MB resident) and multiprocessing's resource tracker, both
  orphaned forever by a SIGKILL of the trainer;
- its shard writers are forked per save with no parent-death rule, and the parent waits for them on a joinable queue
  that a worker killed before it reports leaves waiting forever.

`save_strategy()` is the same strategy for a synchronous save (the only kind megappo makes): the results never leave
the process, so they go through a plain in-process queue and no manager is started; the shard files are written by
the same number of forked workers (`thread_count`, megatron's default 2: the same parallelism and the same files as
before), each started by `child_reaper.fork_process` (SIGKILL on the trainer's death), and a worker that dies without
reporting fails the save (megatron's result check names it) instead of hanging it. Checkpoints are byte-for-byte the
format megatron writes: the writer, planner and file layout are megatron's; only the transport of the write results
and the worker start differ.

Pass it to every `dist_checkpointing.save(..., sharded_strategy=save_strategy())`.
"""
from __future__ import annotations

import contextlib
import inspect
import queue
from functools import partial
from typing import Any, Iterator

__all__ = ["save_strategy", "write_buckets"]

_strategy_class = None


def save_strategy(thread_count: int = 2) -> Any:
    """A fresh torch_dist save strategy for `dist_checkpointing.save(sharded_strategy=...)`; synchronous saves only."""
    global _strategy_class
    if _strategy_class is None:
        _strategy_class = _make_class()
    return _strategy_class("torch_dist", 1, thread_count=thread_count)


def _make_class() -> type:
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    class ReapedTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
        """TorchDistSaveShardedStrategy without a multiprocessing manager, with workers that die with the run."""

        def async_save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> Any:
            raise NotImplementedError("megappo's save strategy saves synchronously (its write results stay in this "
                                      "process); use megatron's own strategy for asynchronous saves")

        def save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
            with _results_in_this_process():
                request = TorchDistSaveShardedStrategy.async_save(self, sharded_state_dict, checkpoint_dir)
            request.execute_sync()

        def _get_save_and_finalize_callbacks(self, writer: Any, save_state_dict_ret: Any) -> Any:
            request = super()._get_save_and_finalize_callbacks(writer, save_state_dict_ret)
            if request.async_fn is None:  # nothing to write on this rank
                return request
            transform_list = [writer.transforms] if hasattr(writer, "transforms") else []
            return request._replace(async_fn=partial(write_buckets, transform_list, writer.use_msc))

    return ReapedTorchDistSaveStrategy


@contextlib.contextmanager
def _results_in_this_process() -> Iterator[None]:
    """While a writer prepares its write (inside `async_save`), megatron's results queue is an in-process queue: its
    `_get_write_results_queue()` returns the cached `_results_queue` and only makes a manager when there is none."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    if not (hasattr(fa, "_results_queue") and hasattr(fa, "_get_write_results_queue")):
        raise RuntimeError("megatron-core's FileSystemWriterAsync no longer caches its results queue in "
                           "filesystem_async._results_queue: megappo.models.save_strategy needs an update")
    saved = fa._results_queue
    fa._results_queue = queue.Queue()
    try:
        yield
    finally:
        fa._results_queue = saved


class _Sender:
    """The `results_queue` of a worker: its result goes back through its own pipe."""

    def __init__(self, conn: Any):
        self.conn = conn

    def put(self, item: Any) -> None:
        self.conn.send(item)


class _NoCount:
    """The `count_queue` of a worker: completion is the pipe's message (or its EOF), not a joinable queue."""

    def get(self) -> None:
        return None

    def task_done(self) -> None:
        return None


def _write_one(transform_list: list, use_msc: bool, idx: int, bucket: Any, conn: Any) -> None:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    kwargs = {}
    if use_msc and len(inspect.signature(FileSystemWriterAsync.write_preloaded_data).parameters) > 6:
        kwargs["use_msc"] = use_msc
    FileSystemWriterAsync.write_preloaded_data(transform_list, idx, bucket, _Sender(conn), _NoCount(), True,
                                               **kwargs)
    conn.close()


def write_buckets(transform_list: list, use_msc: bool, rank: int, buckets: list, results_queue: Any) -> None:
    """megatron's `FileSystemWriterAsync.write_preloaded_data_multiproc`: one forked worker per bucket writes (and
    fsyncs) its file; `{worker index: [WriteResult]}`, or the first failure, goes into `results_queue`. The workers
    die with this process (`child_reaper.fork_process`); one that exits without a result is a failure."""
    import gc
    import multiprocessing

    from megappo.platform.child_reaper import fork_process

    gc_was_enabled = gc.isenabled()
    gc.disable()  # as megatron's: a collection while forking could free tensors a worker still writes
    procs, conns = [], []
    results: Any = {}
    try:
        for i, bucket in enumerate(buckets):
            recv, send = multiprocessing.get_context("fork").Pipe(duplex=False)
            proc = fork_process(_write_one, args=(transform_list, use_msc, i, bucket, send),
                                name=f"megappo-ckpt-writer-{rank}-{i}")
            proc.start()
            send.close()  # the worker holds the only write end: its death reads as EOF here
            procs.append(proc)
            conns.append(recv)
        for i, (proc, recv) in enumerate(zip(procs, conns)):
            try:
                idx, out = recv.recv()
            except (EOFError, OSError):
                proc.join()
                out = RuntimeError(f"checkpoint writer worker {i} of rank {rank} exited with code {proc.exitcode} "
                                   "without writing its file")
                idx = i
            if isinstance(out, BaseException):
                results = out
                break
            results[idx] = out
            proc.join()
    finally:
        for proc in procs:
            if proc.is_alive():  # a failure elsewhere, or an interrupted save: the workers go with it
                proc.kill()
            proc.join()
        for recv in conns:
            recv.close()
        if gc_was_enabled:
            gc.enable()
    results_queue.put(results)
