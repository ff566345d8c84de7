"""The in-process engine run in a child process (`HFProcessEngine`) against `HFEngine` in this one: the same tokens
and log-probs, generation overlapping this process's compute, abort, weight updates through shared memory, and the
child's life (it ignores job signals, dies with its parent, a dead child fails calls clearly). Also `HFEngine.abort`
from another thread."""
from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace

import psutil
import pytest
import torch

from megappo.rollout.hf.engine import HFEngine
from megappo.rollout.hf.process import HFProcessEngine
from megappo.rollout.sampling import SamplingParams
from megappo.testing.completions import tokens
from megappo.testing.procs import process_gone

torch.set_num_threads(1)
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [3]]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0)
SAMPLED = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.9, n=2, seed=11)
LONG = SamplingParams(max_new_tokens=480, temperature=1.0, seed=5, ignore_eos=True)  # ~1-2 s per forward batch
SHORT = replace(LONG, max_new_tokens=96)


def _assert_same(got, want, tol=1e-6):
    assert tokens(got) == tokens(want)
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            assert a.prompt_index == b.prompt_index and a.finish_reason == b.finish_reason
            assert len(a.log_probs) == len(b.log_probs)
            assert max((abs(x - y) for x, y in zip(a.log_probs, b.log_probs)), default=0.0) <= tol


_gone = process_gone


def _cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def _weights(hf_dir):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(glob.glob(os.path.join(hf_dir, "*.safetensors"))):
        out.update(load_file(f))
    return sorted(out.items())


def _buckets(pairs, size=5):
    return [pairs[i:i + size] for i in range(0, len(pairs), size)]


@pytest.fixture(scope="module")
def engines(hf_model_dir):
    """(child-process engine, in-process engine) on the same tiny Qwen2, two sequences per forward batch."""
    hf_dir = hf_model_dir("qwen2")
    proc = HFProcessEngine(hf_dir, threads=1, max_num_seqs=2)
    try:
        yield proc, HFEngine(hf_dir, max_num_seqs=2)
    finally:
        proc.close()


@pytest.mark.timeout(120)
def test_generate_and_log_probs_equal_the_in_process_engine(engines):
    proc, local = engines
    for params in (GREEDY, SAMPLED, replace(SAMPLED, n=1, top_k=5, seed=3)):
        _assert_same(proc.generate(PROMPTS, params), local.generate(PROMPTS, params))
    _assert_same(proc.generate(PROMPTS[1:], SAMPLED, prompt_offset=1),
                 local.generate(PROMPTS[1:], SAMPLED, prompt_offset=1))
    ids = PROMPTS[1] + PROMPTS[0]
    assert proc.prompt_log_probs(ids) == local.prompt_log_probs(ids)
    with pytest.raises(ValueError, match="at least one token"):
        proc.generate([[]], GREEDY)


@pytest.mark.timeout(120)
def test_submit_returns_at_once_and_the_child_generates_while_this_process_computes(engines):
    proc, local = engines
    handle = proc.submit(PROMPTS, SHORT)
    x = torch.randn(192, 192)
    stamps = []
    while not handle.done():  # this process's own work, while the child generates
        for _ in range(10):
            x = torch.tanh(x @ x)
        stamps.append(time.monotonic())
    got = handle.result(timeout=60)
    assert handle.started_at is not None and handle.finished_at is not None
    during = [t for t in stamps if handle.started_at < t < handle.finished_at]
    assert len(during) >= 3, (len(stamps), handle.started_at, handle.finished_at)
    _assert_same(got, local.generate(PROMPTS, SHORT))


@pytest.mark.timeout(120)
def test_abort_returns_the_tokens_so_far_and_skips_what_is_queued(engines):
    proc, local = engines
    first, second = proc.submit(PROMPTS, LONG), proc.submit(PROMPTS, GREEDY)
    cpu = _cpu_s(proc.pid)
    deadline = time.monotonic() + 60
    while _cpu_s(proc.pid) < cpu + 0.3 and time.monotonic() < deadline:  # the child is decoding
        time.sleep(0.02)
    proc.abort()
    got = first.result(timeout=30)
    rows = [c for g in got for c in g]
    assert all(c.finish_reason == "abort" for c in rows)
    # the first forward batch (two rows) stopped part way; the second never started
    assert 0 < len(rows[0].output_ids) == len(rows[1].output_ids) < LONG.max_new_tokens
    full = local.generate(PROMPTS[:2], replace(LONG, max_new_tokens=len(rows[0].output_ids)))  # the same prefix
    for c, want in zip(rows[:2], [full[0][0], full[1][0]]):
        assert c.output_ids == want.output_ids[:len(c.output_ids)]
        assert c.log_probs == pytest.approx(want.log_probs[:len(c.log_probs)], abs=1e-6)
    assert rows[2].output_ids == [] and rows[2].log_probs == []
    # a request queued behind it when abort() came returns empty
    queued = second.result(timeout=30)
    assert [[(c.output_ids, c.finish_reason) for c in g] for g in queued] == [[([], "abort")]] * 3
    # the next request runs in full
    _assert_same(proc.generate(PROMPTS, GREEDY), local.generate(PROMPTS, GREEDY))


@pytest.mark.timeout(120)
def test_the_child_ignores_job_signals(engines):
    proc, local = engines
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        os.kill(proc.pid, sig)
    time.sleep(0.3)
    assert proc.alive
    _assert_same(proc.generate(PROMPTS, GREEDY), local.generate(PROMPTS, GREEDY))


@pytest.mark.timeout(180)
def test_weight_updates_equal_an_in_process_engine_on_the_same_weights(engines, hf_model_dir, tmp_path):
    """(On the module's engine, left on its first weights again.)"""
    from megappo.testing.hf_models import make_hf_model

    proc, local = engines
    old = hf_model_dir("qwen2")
    new = make_hf_model("qwen2", str(tmp_path / "new"), seed=1)
    pairs = _weights(new)
    before = proc.generate(PROMPTS, GREEDY)
    mid = []

    def export():  # several buckets: the two staging slots are refilled as the child copies them out
        for k, bucket in enumerate(_buckets(pairs)):
            yield bucket
            if k == 1:  # a generation submitted during the update runs after it
                mid.append(proc.submit(PROMPTS, SAMPLED))

    assert proc.update_weights(export(), version=7) == 7 == proc.weight_version
    want_engine = HFEngine(new, max_num_seqs=2)
    want = want_engine.generate(PROMPTS, SAMPLED)
    for got in (mid[0].result(timeout=60), proc.generate(PROMPTS, SAMPLED)):
        _assert_same(got, want)
        assert all(c.weight_version == 7 for g in got for c in g)
    assert tokens(proc.generate(PROMPTS, GREEDY)) != tokens(before)
    assert proc.prompt_log_probs(PROMPTS[1]) == want_engine.prompt_log_probs(PROMPTS[1])

    # a bad update fails with the child's error, and the engine goes on
    with pytest.raises(ValueError, match="parameters unset"):
        proc.update_weights(_buckets(pairs)[:2], version=8)
    with pytest.raises(KeyError, match="no parameter"):
        proc.update_weights([[("model.nonexistent.weight", torch.zeros(2))]] + _buckets(pairs), version=8)

    def failing_export():
        yield pairs[:3]
        raise OSError("export failed")

    with pytest.raises(OSError, match="export failed"):
        proc.update_weights(failing_export(), version=8)
    assert proc.weight_version == 7
    # from disk; a generation submitted while paused waits for resume() and samples the new weights
    proc.pause()
    held = proc.submit(PROMPTS, GREEDY)
    assert proc.update_weights_from_disk(old, version=9) == 9
    assert not held.done()
    proc.resume()
    _assert_same(held.result(timeout=60), local.generate(PROMPTS, GREEDY))
    assert all(c.weight_version == 9 for g in held.result() for c in g)


@pytest.mark.timeout(120)
def test_a_killed_child_fails_calls_clearly_and_close_leaves_no_process(hf_model_dir):
    proc = HFProcessEngine(hf_model_dir("qwen2"), threads=1)
    pid = proc.pid
    try:
        assert psutil.Process(pid).ppid() == os.getpid()
        assert proc.generate(PROMPTS, GREEDY)
        handle = proc.submit(PROMPTS, LONG)
        os.kill(pid, signal.SIGKILL)  # what the OOM killer does
        with pytest.raises(RuntimeError, match=r"died with exit code -9"):
            handle.result(timeout=30)
        with pytest.raises(RuntimeError, match=r"died with exit code -9"):
            proc.generate(PROMPTS, GREEDY)
        with pytest.raises(RuntimeError, match=r"died with exit code -9"):
            proc.update_weights([], version=1)
    finally:
        proc.close()
    proc.close()  # idempotent
    assert _gone(pid, 10)

    proc = HFProcessEngine(hf_model_dir("qwen2"), threads=1)
    pid = proc.pid
    try:
        pending = proc.submit(PROMPTS, LONG)  # close() aborts it
    finally:
        proc.close()
    assert pending.result(timeout=10)[0][0].finish_reason == "abort"
    assert _gone(pid, 10) and pid not in [p.pid for p in psutil.Process().children(recursive=True)]
    with pytest.raises(RuntimeError, match="closed"):
        proc.generate(PROMPTS, GREEDY)


PARENT = textwrap.dedent("""
    import sys, threading, torch
    from megappo.rollout.hf.process import HFProcessEngine
    from megappo.rollout.sampling import SamplingParams

    if __name__ == "__main__":
        main = HFProcessEngine(sys.argv[1])
        made = []
        t = threading.Thread(target=lambda: made.append(HFProcessEngine(sys.argv[1])))  # a thread that then ends
        t.start()
        t.join()
        for e in (main, made[0]):  # both outlive the thread that started the second
            assert e.generate([[1, 2]], SamplingParams(max_new_tokens=2, temperature=0))
        print(main.pid, made[0].pid, flush=True)
        threading.Event().wait()
""")


@pytest.mark.timeout(180)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux process semantics")
def test_the_child_dies_with_its_sigkilled_parent(hf_model_dir, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script), hf_model_dir("qwen2")], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
    children = []
    try:
        line = parent.stdout.readline()
        assert len(line.split()) == 2, f"the parent printed {line!r} (exit code {parent.poll()})"
        children = [int(p) for p in line.split()]
        assert all(psutil.Process(c).ppid() == parent.pid for c in children)
    finally:
        parent.kill()  # SIGKILL: no handler, atexit or finaliser of the parent runs
        parent.wait(timeout=10)
        parent.stdout.close()
    try:
        assert all(_gone(c, 15) for c in children), [c for c in children if psutil.pid_exists(c)]
    finally:
        for c in children:
            try:
                os.kill(c, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.timeout(120)
def test_hf_engine_abort_from_another_thread(hf_model_dir):
    """abort() while `generate` runs in another thread: the first forward batch returns the tokens it had at the
    decode step that saw the abort, the forward batches after it return empty; the next generate is whole."""
    engine = HFEngine(hf_model_dir("qwen2"), max_num_seqs=2)
    params = replace(LONG, max_new_tokens=64)
    full = engine.generate(PROMPTS, params)
    reached, go = threading.Event(), threading.Event()
    calls = []

    def hook(module, args, output):
        calls.append(1)
        if len(calls) == 5:  # the prefill and 4 decode steps: 4 tokens sampled
            reached.set()
            go.wait(30)

    handle = engine.model.register_forward_hook(hook)
    out = []
    worker = threading.Thread(target=lambda: out.append(engine.generate(PROMPTS, params)))
    try:
        worker.start()
        assert reached.wait(30)
        engine.abort()
        go.set()
        worker.join(30)
    finally:
        go.set()
        handle.remove()
    assert not worker.is_alive()
    rows, want = [c for g in out[0] for c in g], [c for g in full for c in g]
    assert [c.finish_reason for c in rows] == ["abort"] * 3
    assert [len(c.output_ids) for c in rows] == [4, 4, 0]
    for c, w in zip(rows, want):
        assert c.output_ids == w.output_ids[:len(c.output_ids)]
        assert c.log_probs == pytest.approx(w.log_probs[:len(c.log_probs)], abs=1e-6)
    engine.abort()  # nothing in flight: the next generate is unaffected
    _assert_same(engine.generate(PROMPTS, params), full)


@pytest.mark.timeout(60)
def test_a_child_that_cannot_load_the_model_raises_its_error_here(tmp_path):
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # multiprocessing's, for the life of this process
    before = {p.pid for p in psutil.Process().children()}
    with pytest.raises(FileNotFoundError, match="config.json"):
        HFProcessEngine(str(tmp_path / "missing"))
    assert all(_gone(p.pid, 10) for p in psutil.Process().children() if p.pid not in before)


def test_deploy_takes_the_thread_budget_from_engine_kwargs(monkeypatch):
    from types import SimpleNamespace

    import megappo.rollout.hf.deploy as hf_deploy

    built = []
    monkeypatch.setattr(hf_deploy, "HFProcessEngine", lambda path, **kw: built.append((path, kw)) or "engine")
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    settings = SimpleNamespace(engine_kwargs={"threads": 3}, max_num_seqs=8, model_path="/m", trust_remote_code=False,
                               seed=4)
    platform = SimpleNamespace(dtype=torch.float32, device=torch.device("cpu"))
    deployment = hf_deploy.deploy_process(settings, SimpleNamespace(mp_group=None), platform)
    assert deployment.engine == deployment.sync_target == "engine"
    assert built == [("/m", dict(threads=3, dtype=torch.float32, device=torch.device("cpu"), max_num_seqs=8, seed=4,
                                 trust_remote_code=False))]
    settings.engine_kwargs = {}
    hf_deploy.deploy_process(settings, SimpleNamespace(mp_group=None), platform)
    assert built[-1][1]["threads"] == 1
    settings.engine_kwargs = {"thread": 2}
    with pytest.raises(ValueError, match="thread"):
        hf_deploy.deploy_process(settings, SimpleNamespace(mp_group=None), platform)


def test_a_closed_engine_leaves_nothing_for_the_resource_tracker_to_report(hf_model_dir, tmp_path):
    """A program that uses the engine and closes it exits quietly: the child's fast exit releases what
    multiprocessing registered in it, so no "leaked semaphore" warning reaches the user at the trainer's exit."""
    script = tmp_path / "use_engine.py"
    script.write_text(textwrap.dedent(f"""
        from megappo.rollout import SamplingParams
        from megappo.rollout.hf.process import HFProcessEngine

        if __name__ == "__main__":
            engine = HFProcessEngine({hf_model_dir("qwen2")!r})
            print(engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, seed=1))[0][0].output_ids)
            engine.close()
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "leaked" not in done.stderr, done.stderr[-2000:]
