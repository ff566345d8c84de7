"""Preemption of a train.sbatch job whose trainer runs its own SGLang server and reward worker, on the local Slurm
cluster (tests/cluster/conftest.py): a job of a higher-priority partition takes its node, and slurmctld preempts it
(PreemptMode=REQUEUE, GraceTime): slurmd sends SIGCONT and SIGTERM to every process of every job step, torchrun.sh,
torchrun, the ranks, and the ranks' helpers (server, its scheduler and detokenizer, reward worker) alike, but not to
the batch script (measured). The helpers ignore it, so the trainer finishes its step, saves, stops them itself and
exits 75; the job is requeued, and resumes and finishes with the same per-step metrics as an uninterrupted job, without any server restarted and with
no process left. (The batch script's srun would answer a SIGTERM of its own by killing the step: `scancel --full`
sends one, preemption does not.)"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from megappo.testing.prompts import assert_same_rows, metrics_so_far, tiny_run_overrides, write_prompt_parquet

# long (about 2 minutes): its parts run in the default tier, Slurm's requeue and resume in tests/cluster/test_slurm.py
# and SIGTERM to a trainer with its own SGLang server in tests/e2e/test_sglang_preemption.py
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.sglang, pytest.mark.long]
REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "launch" / "slurm" / "train.sbatch"
STEPS = 10  # tiny steps take about 0.5 s: the preemption (about 0.5 s after step 1) must land before the last
JOB_TIMEOUT = 420  # an SGLang server's cold start on a loaded 2-core machine takes minutes


def _env(slurm, tmp: Path) -> dict[str, str]:
    """The job's environment: this interpreter's venv, a home of its own, one thread per rank."""
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    env = dict(slurm.env, HOME=str(home), HF_HOME=str(home / "hf"), MEGAPPO_CPU_THREADS="1", OMP_NUM_THREADS="1",
               GPUS_PER_NODE="0", MEGAPPO_HOME=str(REPO))
    if sys.prefix != sys.base_prefix and (Path(sys.prefix) / "bin" / "activate").exists():
        env["MEGAPPO_VENV"] = sys.prefix
    return env


def _log(directory: Path, job_id: str) -> str:
    path = directory / f"megappo-train-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def _overrides(out: Path, model: str, train: str, sglang_python: str) -> list[str]:
    return tiny_run_overrides(
        str(out), model, train, steps=STEPS,
        extra=["actor_rollout_ref.rollout.name=sglang", f"actor_rollout_ref.rollout.server_python={sglang_python}",
               "actor_rollout_ref.rollout.verify_sync=true", f"trainer.save_freq={STEPS}",
               "reward_model.backend=process", "reward_model.num_workers=1",
               # greedy: SGLang honours sampling seeds only with --enable-deterministic-inference, which it has no
               # CPU attention backend for, so sampled rollouts of two runs differ; argmax ones do not
               "actor_rollout_ref.rollout.temperature=0",
               "data.max_response_length=32"])  # a rollout of a few seconds: the signal lands inside a step


@pytest.mark.timeout(2 * JOB_TIMEOUT + 60)
def test_preemption_sigterm_to_every_process_saves_requeues_and_resumes_to_the_same_metrics(
        slurm, sglang_python, hf_model_dir, tmp_path):
    model = hf_model_dir("qwen2")
    train = write_prompt_parquet(str(tmp_path / "train.parquet"), 16)
    jobs = {}
    for name in ("reference", "preempted"):  # side by side, one on each node (--exclusive)
        tmp = tmp_path / name
        tmp.mkdir()
        args = [str(TRAIN), "--config", "gsm8k/tiny_cpu", *_overrides(tmp / "run", model, train, sglang_python)]
        job = slurm.run("sbatch", "--parsable", *args, cwd=tmp, env=_env(slurm, tmp)).stdout
        jobs[name] = (tmp, job.strip().split(";")[0])
    tmp, job_id = jobs["preempted"]
    out = tmp / "run"

    deadline = time.monotonic() + JOB_TIMEOUT
    while not any(r.get("step") == 1 for r in metrics_so_far(out)):
        state = slurm.job(job_id).get("JobState")
        if state not in ("PENDING", "RUNNING", "CONFIGURING") or time.monotonic() > deadline:
            pytest.fail(f"job {job_id} ({state}) never logged step 1:\n{_log(tmp, job_id)[-4000:]}")
        time.sleep(0.05)
    # a job of the urgent partition takes the node: slurmctld preempts this one (PreemptMode=REQUEUE, GraceTime 60 s),
    # and slurmd sends SIGTERM to every process of its steps, not to the batch script
    urgent = tmp_path / "urgent.sh"
    urgent.write_text(f"#!/bin/bash\n#SBATCH -p urgent --exclusive -N1 -w {slurm.job(job_id)['NodeList']} "
                      f"-o {tmp_path}/urgent-%j.out\nsleep 1\n")
    urgent_id = slurm.run("sbatch", "--parsable", str(urgent)).stdout.strip().split(";")[0]

    info = slurm.wait_job(job_id, JOB_TIMEOUT)
    log = _log(tmp, job_id)
    assert slurm.job(urgent_id)["JobState"] == "COMPLETED"  # it took the node in between
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-5000:]
    assert info["Restarts"] == "1", log[-5000:]  # one stop, one requeue, one resumed run that finished
    assert "SIGTERM received: saving a checkpoint after this step" in log, log[-5000:]
    assert "preempted after a checkpoint: requeueing job" in log and "(restart 1)" in log, log[-5000:]
    assert "is dead" not in log and "restarting it" not in log, log[-5000:]  # no helper died, none restarted
    ref_info = slurm.wait_job(jobs["reference"][1], JOB_TIMEOUT)
    ref_log = _log(*jobs["reference"])
    assert ref_info["JobState"] == "COMPLETED" and ref_info["Restarts"] == "0", ref_log[-4000:]
    assert json.loads((out / "run_status.json").read_text())["status"] == "finished"

    expected, got = metrics_so_far(jobs["reference"][0] / "run"), metrics_so_far(out)
    assert [r["step"] for r in got] == [r["step"] for r in expected] == list(range(1, STEPS + 1))
    # the step the signal came in finished and was saved (besides the guard's step 0 and save_freq's last step, the
    # one checkpoint is the preemption's), its weight sync skipped when the signal came before it (the servers were
    # stopped next)
    saved = sorted(int(d.name.rsplit("_", 1)[1]) for d in (out / "checkpoints").glob("global_step_*"))
    assert len(saved) == 3 and saved[0] == 0 and saved[1] < STEPS == saved[2], saved
    saved = saved[1:]
    assert [r["step"] for r in got if r.get("rollout/weight_sync_skipped")] in ([], [saved[0]]), got
    assert_same_rows(expected, got)
    for r in got:  # the resumed run's fresh server got the saved weights: it generates what the actor would
        assert r["rollout/logprob_diff_mean"] <= 1e-3 and r.get("rollout/verify_sync_max_diff", 0.0) <= 1e-3, r
    slurm.wait_no_leftovers()
