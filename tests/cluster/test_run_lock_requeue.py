"""The requeue race on a real Slurm cluster (conftest.py): a job stopped before its time limit (SIGUSR1 to the batch
script) saves, exits 75 and requeues itself; its next incarnation can start while the previous one's rank 0 still
holds trainer.default_local_dir (still exiting, or an NFS lock outliving it for a lease period). Here a process
standing in for that lingering incarnation holds the directory's lock when the requeued job starts: with the
trainer.dir_lock_wait_s=300 that launch/slurm/train.sbatch passes, the requeued run waits, naming the holder, and
trains to the end once it lets go, instead of failing or resuming from files another run still writes."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megappo.testing.prompts import metrics_so_far

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "launch" / "slurm" / "train.sbatch"
STEPS = 8
OVERRIDES = [f"trainer.total_training_steps={STEPS}", "trainer.save_freq=4", "trainer.test_freq=-1",
             "trainer.logger=[]", "data.train_batch_size=16", "data.synthetic.num_train_prompts=64",
             "data.synthetic.num_val_prompts=16", "data.synthetic.warm_start_steps=30",
             "actor_rollout_ref.actor.ppo_mini_batch_size=8"]
JOB_TIMEOUT = 300

# takes the lock as soon as the preempted incarnation lets go of it, holds it until told (a line on stdin)
HOLDER = textwrap.dedent("""
    import sys
    from megappo.trainer.run_lock import RunLock
    lock = RunLock(sys.argv[1]).acquire(wait_s=120, poll_s=0.05)
    print("locked", flush=True)
    sys.stdin.readline()
    lock.release()
""")


def _status(out: Path) -> dict:
    try:
        return json.loads((out / "run_status.json").read_text())
    except (OSError, ValueError):
        return {}


def _until(what: str, ready, slurm, job_id: str, log: Path, timeout: float = JOB_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        state = slurm.job(job_id).get("JobState")
        if state in ("COMPLETED", "FAILED", "CANCELLED") or time.monotonic() > deadline:
            text = log.read_text(errors="replace")[-4000:] if log.exists() else ""
            pytest.fail(f"job {job_id} ({state}) never reached {what}:\n{text}")
        time.sleep(0.1)


@pytest.mark.timeout(2 * JOB_TIMEOUT)
# ~75 s: the wait is tests/e2e/test_one_run_per_directory.py's (with the sbatch's wait, no Slurm) and the requeue
# test_slurm.py's (SIGUSR1, real Slurm); this is the two together: the long tier
@pytest.mark.long
def test_a_requeued_job_waits_for_its_lingering_previous_incarnation(slurm, tmp_path):
    out = tmp_path / "run"
    home = tmp_path / "home"
    home.mkdir()
    env = dict(slurm.env, HOME=str(home), HF_HOME=str(home / "hf"), MEGAPPO_CPU_THREADS="1", OMP_NUM_THREADS="1",
               GPUS_PER_NODE="0", MEGAPPO_HOME=str(REPO),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    job_id = slurm.run("sbatch", "--parsable", str(TRAIN), "--config", "recipes/cpu/tiny_ppo.yaml",
                       f"trainer.default_local_dir={out}", *OVERRIDES, cwd=tmp_path, env=env
                       ).stdout.strip().split(";")[0]
    log = tmp_path / f"megappo-train-{job_id}.out"
    holder = None
    try:
        _until("step 1", lambda: any(r.get("step") == 1 for r in metrics_so_far(out)), slurm, job_id, log)
        slurm.run("scancel", "--batch", "--signal=USR1", job_id)  # what --signal=B:USR1@600 sends
        # the trainer writes "preempted" just before it lets go of the directory and exits 75; the job is requeued
        # and starts again after Slurm's credential delay (cred_expire + 1 s): the stand-in takes the lock first
        _until("preemption", lambda: _status(out).get("status") == "preempted", slurm, job_id, log)
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
        assert holder.stdout.readline().strip() == "locked"
        _until("the requeued run's wait", lambda: "waiting up to 300 s" in log.read_text(errors="replace"),
               slurm, job_id, log)
        time.sleep(2)
        text = log.read_text(errors="replace")
        assert "(restart 1)" in text and f"pid {holder.pid} on " in text, text[-4000:]
        assert _status(out).get("status") == "preempted"  # the waiting run has not started training
        holder.stdin.write("go\n")
        holder.stdin.flush()
        assert holder.wait(30) == 0
        info = slurm.wait_job(job_id, JOB_TIMEOUT)
    finally:
        if holder is not None and holder.poll() is None:
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait(30)
    text = log.read_text(errors="replace")
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0" and info["Restarts"] == "1", text[-4000:]
    assert "is free now: this run holds it" in text and "is in use by another megappo run" in text
    status = _status(out)
    assert status["status"] == "finished" and status["step"] == STEPS
    rows = metrics_so_far(out)
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    assert all(math.isfinite(r["reward/mean"]) for r in rows[1:])
    slurm.wait_no_leftovers()
