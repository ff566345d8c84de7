"""launch/slurm on a real Slurm cluster (conftest.py: two nodes on this machine, CPUs only):

- `sbatch launch/slurm/train.sbatch` submitted outside the repository trains the tiny CPU recipe and logs every step;
- SIGUSR1 to the batch script (what `#SBATCH --signal=B:USR1@...` sends before the time limit) makes the trainer save
  and exit 75, the job requeue itself, and the requeued run resume to exactly the metrics of the uninterrupted run
  (on CPU with one thread per rank the trainer is deterministic across a resume);
- on two nodes the stop request reaches the ranks on both, and both launchers report the trainer's 75;
- launch/convert.sbatch runs on nodes without GPUs, on two of them.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import pytest

from megappo.testing.prompts import assert_same_rows, metrics_so_far

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "launch" / "slurm" / "train.sbatch"
STEPS = 12
# 12 steps of ~0.15 s: a stop request sent at step 1 arrives (~1 s through Slurm) well before the last step
OVERRIDES = [f"trainer.total_training_steps={STEPS}", "trainer.save_freq=5", "trainer.test_freq=6", "trainer.logger=[]",
             "data.train_batch_size=16", "data.synthetic.num_train_prompts=64", "data.synthetic.num_val_prompts=16",
             "data.synthetic.warm_start_steps=30", "actor_rollout_ref.actor.ppo_mini_batch_size=8"]
JOB_TIMEOUT = 240


def _env(slurm, tmp: Path, **extra: str) -> dict[str, str]:
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    return dict(slurm.env, HOME=str(home), HF_HOME=str(home / "hf"), MEGAPPO_CPU_THREADS="1", OMP_NUM_THREADS="1",
                GPUS_PER_NODE="0", **extra)


def _with_venv(env: dict[str, str]) -> dict[str, str]:
    """This interpreter's environment for the job: MEGAPPO_VENV when it is a venv, else its bin/ first on PATH."""
    if sys.prefix != sys.base_prefix and (Path(sys.prefix) / "bin" / "activate").exists():
        return dict(env, MEGAPPO_VENV=sys.prefix)
    return _on_path(env)


def _on_path(env: dict[str, str]) -> dict[str, str]:
    return dict(env, PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""))


def _log(directory: Path, job_id: str, name: str = "megappo-train") -> str:
    return (directory / f"{name}-{job_id}.out").read_text(errors="replace")


def _submit(slurm, args: list[str], cwd: Path, env: dict[str, str]) -> str:
    return slurm.run("sbatch", "--parsable", *args, cwd=cwd, env=env).stdout.strip().split(";")[0]


def _stop_at_first_step(slurm, job_id: str, out: Path, log: Path) -> None:
    """Once step 1 is logged, SIGUSR1 to the batch script only, as `--signal=B:USR1@...` delivers it."""
    deadline = time.monotonic() + JOB_TIMEOUT
    while not any(r.get("step") == 1 for r in metrics_so_far(out)):
        state = slurm.job(job_id).get("JobState")
        if state in ("COMPLETED", "FAILED", "CANCELLED") or time.monotonic() > deadline:
            text = log.read_text(errors="replace")[-4000:] if log.exists() else ""
            pytest.fail(f"job {job_id} ({state}) never logged step 1:\n{text}")
        time.sleep(0.1)
    slurm.run("scancel", "--batch", "--signal=USR1", job_id)


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory):
    """One node, one rank, never interrupted, submitted with `sbatch --wait` from a directory that is not the
    repository (MEGAPPO_HOME and MEGAPPO_VENV find it and its Python): (submit dir, output dir, job id)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    out = tmp / "run"
    env = _with_venv(_env(slurm, tmp, MEGAPPO_HOME=str(REPO)))
    proc = slurm.run("sbatch", "--wait", "--parsable", str(TRAIN), "--config", "recipes/cpu/tiny_ppo.yaml",
                     f"trainer.default_local_dir={out}", *OVERRIDES, cwd=tmp, env=env, timeout=JOB_TIMEOUT,
                     check=False)
    job_id = proc.stdout.strip().split(";")[0]
    log = tmp / f"megappo-train-{job_id}.out"
    assert proc.returncode == 0, f"{proc.stderr}\n{log.read_text()[-4000:] if log.exists() else ''}"
    return tmp, out, job_id


@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_train_sbatch_from_outside_the_repository_logs_every_step(slurm, uninterrupted):
    tmp, out, job_id = uninterrupted
    log = _log(tmp, job_id)  # megappo-train-<job id>.out in the submit directory
    assert "1 node(s) x 1 rank(s)" in log, log[-3000:]
    rows = metrics_so_far(out)
    assert [r["step"] for r in rows] == list(range(STEPS + 1)), log[-3000:]
    for row in rows[1:]:
        for key in ("reward/mean", "kl/mean", "actor/pg_loss", "critic/vf_loss", "actor/grad_norm"):
            assert math.isfinite(row[key]), f"step {row['step']}: {key} = {row[key]}"
    assert json.loads((out / "run_status.json").read_text())["status"] == "finished"
    assert slurm.job(job_id)["Restarts"] == "0"
    slurm.wait_no_leftovers()


@pytest.mark.timeout(2 * JOB_TIMEOUT)
def test_sigusr1_before_the_time_limit_requeues_and_resumes_to_the_same_metrics(slurm, uninterrupted, tmp_path):
    """Submitted from the repository root without MEGAPPO_HOME or MEGAPPO_VENV (the submit directory is the
    repository, `python` on PATH has megappo); the job runs in tmp_path (--chdir), where its log goes."""
    _, reference, _ = uninterrupted
    out = tmp_path / "run"
    env = _on_path(_env(slurm, tmp_path))
    job_id = _submit(slurm, [f"--chdir={tmp_path}", "launch/slurm/train.sbatch", "--config",
                             "recipes/cpu/tiny_ppo.yaml", f"trainer.default_local_dir={out}", *OVERRIDES], REPO, env)
    _stop_at_first_step(slurm, job_id, out, tmp_path / f"megappo-train-{job_id}.out")
    info = slurm.wait_job(job_id, JOB_TIMEOUT)
    log = _log(tmp_path, job_id)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-4000:]
    # one stop, one requeue, one resumed run that finished
    assert info["Restarts"] == "1", log[-4000:]
    assert log.count("SIGUSR2 -> SIGUSR1 to the ranks") == 1 and "requeueing job" in log, log[-4000:]
    assert "(restart 1)" in log
    status = json.loads((out / "run_status.json").read_text())
    assert status["status"] == "finished" and status["step"] == STEPS

    expected, got = metrics_so_far(reference), metrics_so_far(out)
    assert [r["step"] for r in got] == [r["step"] for r in expected] == list(range(STEPS + 1))
    assert_same_rows(expected, got)
    slurm.wait_no_leftovers()


@pytest.mark.multirank
@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_two_nodes_both_get_the_stop_request_and_save_one_checkpoint(slurm, tmp_path):
    """`sbatch --nodes=2`: one torchrun.sh per node, one rank each. The stop request reaches the ranks on both
    nodes, which save one checkpoint together, and both launchers report 75. Submitted with --no-requeue (resuming
    is the one-node test's), so the batch script says how to continue and ends with 75."""
    out = tmp_path / "run"
    env = _with_venv(_env(slurm, tmp_path, MEGAPPO_HOME=str(REPO)))
    job_id = _submit(slurm, ["--nodes=2", "--no-requeue", str(TRAIN), "--config", "recipes/cpu/tiny_ppo.yaml",
                             f"trainer.default_local_dir={out}", "trainer.nnodes=2", "trainer.n_gpus_per_node=1",
                             *OVERRIDES], tmp_path, env)
    _stop_at_first_step(slurm, job_id, out, tmp_path / f"megappo-train-{job_id}.out")
    info = slurm.wait_job(job_id, JOB_TIMEOUT)
    log = _log(tmp_path, job_id)
    assert "on n[1-2]: 2 node(s) x 1 rank(s)" in log, log[-4000:]
    assert log.count("SIGUSR2 -> SIGUSR1 to the ranks") == 2, log[-4000:]  # each node's launcher
    assert "scontrol requeue failed: submit the same command again" in log, log[-4000:]
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "75:0" and info["Restarts"] == "0", info
    status = json.loads((out / "run_status.json").read_text())
    assert status["status"] == "preempted" and 1 <= status["step"] < STEPS, status
    rows = metrics_so_far(out)
    assert [r["step"] for r in rows] == list(range(status["step"] + 1))
    assert all(math.isfinite(r["reward/mean"]) for r in rows[1:])
    ckpt = out / "checkpoints" / f"global_step_{status['step']}"
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == str(status["step"])
    assert sorted(p.name for p in (ckpt / "rng").iterdir()) == ["rank_0.pt", "rank_1.pt"]
    assert json.loads((ckpt / "trainer_state.json").read_text())["world_size"] == 2
    slurm.wait_no_leftovers()


@pytest.mark.multirank
@pytest.mark.timeout(JOB_TIMEOUT)
@pytest.mark.long  # train.sbatch's tests cover the discovery and port code convert.sbatch shares
def test_convert_sbatch_runs_on_cpu_nodes_from_any_directory(slurm, hf_model_dir, tmp_path):
    """No GPUs asked for (a CPU-only cluster rejects a GPU request), TP2 as one rank on each of two nodes (their
    rendezvous on the job's own port), the output path relative to the submit directory."""
    hf = hf_model_dir("qwen2")
    env = _with_venv(_env(slurm, tmp_path, MEGAPPO_HOME=str(REPO)))
    proc = slurm.run("sbatch", "--wait", "--parsable", "--nodes=2", str(REPO / "launch" / "convert.sbatch"), hf,
                     "mcore", "2", cwd=tmp_path, env=env, timeout=JOB_TIMEOUT, check=False)
    job_id = proc.stdout.strip().split(";")[0]
    log = tmp_path / f"megappo-convert-{job_id}.out"
    assert proc.returncode == 0, f"{proc.stderr}\n{log.read_text()[-4000:] if log.exists() else ''}"
    assert "2 node(s) x 1 rank(s)" in log.read_text()
    written = json.loads((tmp_path / "mcore" / "megappo_checkpoint.json").read_text())
    assert written["world_size"] == 2 and written["layout"]["tp"] == 2
    assert (tmp_path / "mcore" / "metadata.json").exists() and (tmp_path / "mcore" / "config.json").exists()
    slurm.wait_no_leftovers()
