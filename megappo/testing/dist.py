"""Run a function on N gloo ranks in fresh processes and collect what each rank returns.

Used by multi-rank tests and benchmarks: `run_distributed(fn, 4, arg)` starts four processes, initialises a gloo
process group in each (one torch thread per rank: on a 2-core machine more threads measured 3-4x slower), calls
`fn(rank, world_size, *args)` and returns the list of return values by rank. A failing rank's traceback is raised in
the caller; a hung rank is killed after `timeout` seconds.

Ranks are forked from a forkserver that has imported torch, megatron-core, transformers and megappo's models once
(`PRELOAD`): a spawned rank imported them itself, ~6 s of CPU per rank, most of a small multi-rank test. Each rank is
still a fresh process of its own (no state of the caller, no CUDA, no threads: the server only imported).
"""
from __future__ import annotations

import io
import os
import socket
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt", "transformers",
           "megappo.parallel", "megappo.models.builder", "megappo.models.compute"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(n: int) -> int:
    """A port p with p .. p+n-1 all free now (a launch that also listens on MASTER_PORT+1, beside other tests)."""
    for _ in range(100):
        p = free_port()
        socks = []
        try:
            for q in range(p, p + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports found")


def _worker(fn, rank, world_size, port, args, queue):
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # Serialise here: a tensor put on the queue travels as a shared-memory handle that dies with this process.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - the parent re-raises with this traceback
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _reap(procs, grace: float) -> None:
    """Join the ranks and kill whatever they leave behind.

    Ranks spawn helpers of their own (dist_checkpointing's save workers, multiprocessing resource trackers); a rank
    killed mid-collective orphans them, and on a 2-core machine a few orphans slow every later test.
    """
    import psutil

    descendants = []
    for p in procs:
        try:
            descendants += psutil.Process(p.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            pass
    for p in procs:
        p.join(timeout=grace)
        if p.is_alive():
            p.kill()
            p.join()
    for child in descendants:
        try:
            child.wait(timeout=0.5)
        except psutil.TimeoutExpired:
            child.kill()
        except psutil.NoSuchProcess:
            pass


class RankFailed(RuntimeError):
    pass


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0,
                    start_method: str = "forkserver") -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return results ordered by rank.

    `fn` and `args` must be picklable (a module-level function). Raises RankFailed with the first failing rank's
    traceback, or on timeout. `start_method="spawn"` when the ranks must write to this process's current stdout and
    stderr (pytest's capfd): a rank forked from the server writes to the server's.
    """
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: the first call of this process
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        import queue as queue_mod

        deadline = time.monotonic() + timeout
        for _ in range(world_size):
            while True:
                try:
                    rank, ok, payload = queue.get(timeout=1.0)
                    break
                except queue_mod.Empty:
                    waiting = sorted(set(range(world_size)) - set(results))
                    # a rank that left with os._exit (megappo.parallel.leave_run) or was killed sends nothing
                    gone = [(r, procs[r].exitcode) for r in waiting if procs[r].exitcode is not None]
                    if gone and queue.empty():
                        raise RankFailed(", ".join(f"rank {r} exited with code {c} without a result"
                                                   for r, c in gone))
                    if time.monotonic() > deadline:
                        raise RankFailed(f"ranks {waiting} timed out after {timeout}s")
            if ok:
                import torch

                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break  # the other ranks are likely blocked in a collective
    finally:
        _reap(procs, grace=5 if not errors else 0.5)
    if errors:
        raise RankFailed("\n".join(errors))
    return [results[r] for r in range(world_size)]
