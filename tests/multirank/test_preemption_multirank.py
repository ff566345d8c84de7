"""Preemption at two data-parallel ranks under torchrun: SIGTERM to torchrun (what Slurm sends to the job step)
reaches both workers, which agree to stop after the same step, save one checkpoint together and exit; the same
command then continues from it to the end."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from megappo.testing.dist import free_port
from megappo.testing.prompts import read_metrics, tiny_run_overrides, write_prompt_parquet

pytestmark = [pytest.mark.multirank, pytest.mark.e2e]
STEPS = 12


def _cmd(out, data) -> list[str]:
    overrides = tiny_run_overrides(str(out), data["model"], data["train"], steps=STEPS,
                                   extra=["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                                          "critic.ppo_mini_batch_size=4"])
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
            "-m", "megappo.cli", "train", "--config", "gsm8k/tiny_cpu", *overrides]


def test_sigterm_to_torchrun_saves_on_both_ranks_and_the_run_resumes(tmp_path, hf_model_dir):
    data = {"model": hf_model_dir("qwen2"), "train": write_prompt_parquet(str(tmp_path / "train.parquet"), 16)}
    out, log = tmp_path / "run", tmp_path / "torchrun.log"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(log, "w") as f:
        proc = subprocess.Popen(_cmd(out, data), stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if (out / "metrics.jsonl").exists() and read_metrics(str(out)):
                break
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        proc.wait(90)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # nothing of the run outlives the test
        except ProcessLookupError:
            pass
    text = log.read_text()
    status = json.loads((out / "run_status.json").read_text())
    assert status["status"] == "preempted" and "SIGTERM" in status["reason"], text[-4000:]
    step = status["step"]
    assert 1 <= step < STEPS
    ckpt = out / "checkpoints" / f"global_step_{step}"
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == str(step)
    assert sorted(p.name for p in (ckpt / "rng").iterdir()) == ["rank_0.pt", "rank_1.pt"]
    assert json.loads((ckpt / "trainer_state.json").read_text())["world_size"] == 2

    rerun = subprocess.run(_cmd(out, data), capture_output=True, text=True, env=env, timeout=300)
    assert rerun.returncode == 0, (rerun.stdout + rerun.stderr)[-4000:]
    assert [r["step"] for r in read_metrics(str(out))] == list(range(1, STEPS + 1))
    assert json.loads((out / "run_status.json").read_text())["status"] == "finished"
