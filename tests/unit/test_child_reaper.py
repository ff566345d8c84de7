"""The parent-death rule of megappo's helper processes (`megappo.platform.child_reaper`) and the checkpoint save that
uses it (`megappo.models.save_strategy`): a forked worker dies with its parent even when the parent is SIGKILLed, a
save starts no multiprocessing manager or resource tracker and leaves no process, and a writer worker that dies
fails the save instead of hanging it."""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from megappo.testing.dist import run_distributed
from megappo.testing.procs import process_gone

PARENT = textwrap.dedent("""
    import multiprocessing, os, sys, time
    from megappo.platform.child_reaper import fork_process

    def sleep_forever():
        time.sleep(3600)

    if __name__ == "__main__":
        if sys.argv[1] == "reaped":
            p = fork_process(sleep_forever)
        else:  # what multiprocessing does by itself: no parent-death rule
            p = multiprocessing.get_context("fork").Process(target=sleep_forever)
        p.start()
        print(p.pid, flush=True)
        time.sleep(3600)
""")


_gone = process_gone


def _sigkill_parent(tmp_path, kind: str) -> int:
    """Start a parent that forks a sleeping worker of `kind`, SIGKILL the parent; the worker's pid."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    proc = subprocess.Popen([sys.executable, str(script), kind], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert line.strip().isdigit(), f"the parent printed {line!r} (exit code {proc.poll()})"
        worker = int(line)
        assert psutil.Process(worker).ppid() == proc.pid
    finally:
        proc.kill()  # SIGKILL: no handler, no atexit, no finaliser of the parent runs
        proc.wait(timeout=10)
        proc.stdout.close()
    return worker


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_forked_worker_dies_with_its_sigkilled_parent(tmp_path):
    worker = _sigkill_parent(tmp_path, "reaped")
    assert _gone(worker, within=3), "the worker outlived its SIGKILLed parent"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_without_the_rule_a_forked_worker_outlives_its_parent(tmp_path):
    """The control: the test above would catch a worker without the rule."""
    worker = _sigkill_parent(tmp_path, "plain")
    try:
        assert not _gone(worker, within=1)
    finally:
        try:
            os.kill(worker, signal.SIGKILL)
        except ProcessLookupError:
            pass


LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys, time

    if __name__ == "__main__":  # a launcher as torchrun is: each rank in a session of its own
        rank = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True,
                                env=dict(os.environ, TORCHELASTIC_RUN_ID="test"), stdout=subprocess.PIPE, text=True)
        print(rank.pid, rank.stdout.readline().strip(), flush=True)
        time.sleep(3600)
""")
RANK = textwrap.dedent("""
    import multiprocessing, time
    from megappo.platform.child_reaper import die_with_launcher

    def sleep_forever():
        time.sleep(3600)

    assert die_with_launcher(poll_s=0.1)
    helper = multiprocessing.get_context("fork").Process(target=sleep_forever)  # no rule of its own
    helper.start()
    print(helper.pid, flush=True)
    time.sleep(3600)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and sessions as on Linux")
def test_a_rank_and_its_group_die_with_their_sigkilled_launcher(tmp_path):
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    proc = subprocess.Popen([sys.executable, str(script), RANK], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
    pids: list[int] = []
    try:
        line = proc.stdout.readline().split()
        assert len(line) == 2 and all(x.isdigit() for x in line), f"the launcher printed {line!r}"
        pids = [int(x) for x in line]
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher's group: the rank is in a session of its own
        proc.wait(timeout=10)
        assert all(_gone(pid, within=3) for pid in pids), "the rank or its helper outlived the launcher"
    finally:
        proc.kill()
        proc.stdout.close()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_die_with_launcher_does_nothing_outside_torchrun(monkeypatch):
    from megappo.platform import child_reaper

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert child_reaper.die_with_launcher() is False
    assert child_reaper._launcher_watch is None


def _exits_at_once():
    from megappo.platform.child_reaper import die_with_parent

    die_with_parent(os.getppid() + 1_000_000)  # "the parent is already gone": leave before doing anything
    os._exit(0)


def test_a_worker_whose_parent_is_already_gone_leaves_at_once():
    import multiprocessing

    p = multiprocessing.get_context("fork").Process(target=_exits_at_once)
    p.start()
    p.join(timeout=10)
    assert p.exitcode == 1


def test_a_writer_worker_that_dies_fails_the_save_instead_of_hanging(monkeypatch):
    from megappo.models import save_strategy

    monkeypatch.setattr(save_strategy, "_write_one", lambda *args: os._exit(3))  # the forked workers inherit it
    results: queue.Queue = queue.Queue()
    before = set(psutil.Process().children())  # other tests' helpers (a session's Slurm daemons, torch's shm manager)
    t0 = time.monotonic()
    save_strategy.write_buckets([], False, 0, [("f0", "k0", ([], [])), ("f1", "k1", ([], []))], results)
    out = results.get_nowait()
    assert isinstance(out, RuntimeError) and "exited with code 3" in str(out), out
    assert time.monotonic() - t0 < 10
    assert not set(psutil.Process().children()) - before, "a writer worker was left"


def _save_job(rank, world_size, directory):
    import multiprocessing
    from multiprocessing import resource_tracker

    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megappo.models.save_strategy import save_strategy
    from megappo.platform.cpu_compat import apply_cpu_compat

    apply_cpu_compat()  # as the trainer does on a machine without CUDA (megatron's preload synchronises CUDA)

    def state(a, b):
        return {"a": ShardedTensor.from_rank_offsets("a", a), "b": ShardedTensor.from_rank_offsets("b", b),
                "obj": ShardedObject("obj", {"x": 1}, (1,), (0,)), "plain": 7}

    os.makedirs(directory)
    a, b = torch.arange(12.0).reshape(3, 4), torch.randn(5)
    strategy = save_strategy()
    with pytest.raises(NotImplementedError):  # its results never leave this process: no background save
        strategy.async_save({}, directory)
    for _ in range(2):  # twice: megatron made its manager at the first save and kept it
        dist_checkpointing.save(state(a, b), directory, sharded_strategy=save_strategy())
    helpers = [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    loaded = dist_checkpointing.load(state(torch.zeros(3, 4), torch.zeros(5)), directory)
    return {
        "manager": filesystem_async._results_queue is not None,
        "tracker": getattr(resource_tracker._resource_tracker, "_pid", None) is not None,
        "children": [" ".join(p.cmdline()) for p in helpers] + [c.name for c in multiprocessing.active_children()],
        "files": sorted(os.listdir(directory)),
        "equal": bool(torch.equal(loaded["a"], a) and torch.equal(loaded["b"], b)),
        "obj": loaded["obj"], "plain": loaded["plain"],
    }


def test_a_save_starts_no_manager_leaves_no_process_and_loads_back(tmp_path):
    (out,) = run_distributed(_save_job, 1, str(tmp_path / "ckpt"), timeout=240)
    assert not out["manager"] and not out["tracker"], out
    assert out["children"] == [], out
    assert out["equal"] and out["obj"] == {"x": 1} and out["plain"] == 7, out
    # megatron's layout: thread_count (2) shard files per rank, plus its metadata
    assert [f for f in out["files"] if f.endswith(".distcp")] == ["__0_0.distcp", "__0_1.distcp"], out["files"]
    assert "metadata.json" in out["files"] and ".metadata" in out["files"], out["files"]
