"""Slurm's preemption with a trainer-started SGLang rollout and reward workers: SIGTERM reaches every process of the
job at once, the trainer and its helpers alike. The helpers ignore it (the trainer stops them), so the step in
progress finishes, a checkpoint of it is written, the trainer stops its servers and workers itself (none is
restarted, none is left) and exits 75; the same command continues from that checkpoint with fresh servers that hold
the actor's weights."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megappo.testing.prompts import read_metrics, tiny_run_overrides, write_prompt_parquet

pytestmark = [pytest.mark.e2e, pytest.mark.sglang, pytest.mark.slow, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]


MARKER = "MEGAPPO_TEST_PREEMPTION"  # in the environment of the runs, inherited by all they start


def _left(mark: str) -> list[str]:
    """Live processes whose environment carries MARKER=mark (servers and reward workers inherit the trainer's)."""
    needle, found = f"{MARKER}={mark}".encode(), []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE or p.pid == os.getpid():
                continue
            with open(f"/proc/{p.pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(f"{p.pid} {' '.join(p.cmdline())[:160]}")
        except (OSError, psutil.Error):
            continue
    return found


def _gone_soon(mark: str, within: float = 10.0) -> list[str]:
    """`_left(mark)` once it is empty, or after `within` seconds: a helper ends on its own when the run's last
    process does (multiprocessing's resource tracker reads the end of its pipe), a moment later on a loaded machine."""
    deadline = time.monotonic() + within
    while (left := _left(mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _signal_tree(pid: int, sig: int) -> list[str]:
    """`sig` to the process and everything below it, as Slurm signals every process of a job step; their names."""
    tree = [psutil.Process(pid)]
    tree += tree[0].children(recursive=True)
    names = []
    for p in tree:
        try:
            names.append(" ".join(p.cmdline())[:160])
            p.send_signal(sig)
        except psutil.Error:  # gone or a zombie: nothing to signal
            pass
    return names


# long (over a minute): a job-wide SIGTERM mid-step is tests/e2e/test_resume_exact.py's and
# tests/multirank/test_preemption_multirank.py's, the server ignoring it tests/e2e/test_sglang_lifecycle.py's
# (test_a_job_wide_signal_leaves_the_server_serving); with Slurm: tests/cluster/test_slurm_sglang_preemption.py
@pytest.mark.long
def test_sigterm_to_the_whole_job_mid_rollout_finishes_the_step_and_resumes(sglang_python, hf_model_dir, tmp_path):
    train = write_prompt_parquet(str(tmp_path / "train.parquet"), 16)
    out = tmp_path / "run"
    overrides = tiny_run_overrides(
        str(out), hf_model_dir("qwen2"), train, steps=3,
        extra=["actor_rollout_ref.rollout.name=sglang", f"actor_rollout_ref.rollout.server_python={sglang_python}",
               "actor_rollout_ref.rollout.verify_sync=true", "trainer.save_freq=1",
               "reward_model.backend=process", "reward_model.num_workers=1",
               "data.max_response_length=64"])  # a rollout of seconds: the signal lands inside it
    cmd = [sys.executable, "-m", "megappo.cli", "train", "--config", "gsm8k/tiny_cpu", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", MEGAPPO_CPU_THREADS="1", **{MARKER: str(tmp_path)})
    log = tmp_path / "preempted.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    tracker = out / "checkpoints" / "latest_checkpointed_iteration.txt"
    try:
        deadline = time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline and \
                not (tracker.exists() and tracker.read_text() == "1"):
            time.sleep(0.01)
        assert proc.poll() is None, log.read_text()[-4000:]
        time.sleep(0.3)  # past step 1's stop check: into step 2's rollout
        tree = _signal_tree(proc.pid, signal.SIGTERM)
        assert any("sglang.launch_server" in p for p in tree), f"no SGLang server in the trainer's tree: {tree}"
        assert any("multiprocessing" in p for p in tree), f"no reward worker in the trainer's tree: {tree}"
        started = time.monotonic()
        assert proc.wait(300) == 75, log.read_text()[-4000:]
        stopped_in = time.monotonic() - started
    finally:
        if proc.poll() is None:
            for p in psutil.Process(proc.pid).children(recursive=True):
                p.kill()
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    text = log.read_text()
    status = json.loads((out / "run_status.json").read_text())
    assert status["status"] == "preempted" and status["step"] == 2 and "SIGTERM received" in status["reason"], status
    # the step the signal came in finished and was saved; its sync was skipped (the servers are stopped next)
    assert tracker.read_text() == "2", text[-4000:]
    rows = read_metrics(str(out))
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[1]["rollout/weight_sync_skipped"] == 1.0 and rows[1]["rollout/servers_live"] == 1.0
    assert rows[1]["reward/num_failed"] == 0.0  # the reward worker scored the step the signal came in
    print(f"\nstopped {stopped_in:.1f} s after the signal")
    assert "is dead" not in text and "restarting it" not in text  # no helper died, none was started again
    assert "Traceback" not in text, text[-4000:]
    assert not _gone_soon(str(tmp_path)), f"outlived the preempted run: {_left(str(tmp_path))}"

    # the same command: resumes from step 2, feeds the saved weights to fresh servers, and finishes
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = read_metrics(str(out))
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # the engines generated with exactly the actor's weights, and every sync that ran landed
        assert r["rollout/logprob_diff_mean"] <= 1e-3, r
        assert r.get("rollout/verify_sync_max_diff", 0.0) <= 1e-3, r
    assert "rollout/verify_sync_max_diff" in rows[2]
    assert [r["rollout/weight_version"] for r in rows] == [1, 2, 3]
    assert json.loads((out / "run_status.json").read_text())["status"] == "finished"
    assert not _left(str(tmp_path))
