"""Kill `megappo train` with SIGKILL at several moments (mid-step, mid-checkpoint-write, right after a resume),
start the same command again each time, and compare with a run that was never interrupted: the same metrics, step
for step, and the same final weights. On CPU with one thread per rank the trainer is deterministic, so "the same"
means bit-for-bit (timing metrics aside).

Three steps per epoch and a checkpoint every three steps: every checkpoint is at an epoch boundary, so each resume
also starts an epoch."""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megappo.testing.prompts import assert_same_rows, metrics_so_far, read_metrics

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
STEPS = 8
OVERRIDES = [
    f"trainer.total_training_steps={STEPS}", "trainer.save_freq=3", "trainer.test_freq=4", "trainer.logger=[]",
    "data.train_batch_size=32", "data.synthetic.num_train_prompts=96", "data.synthetic.num_val_prompts=16",
    "data.synthetic.warm_start_steps=30", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.actor.ppo_epochs=2",
]


def _command(out: Path) -> list[str]:
    return [sys.executable, "-m", "megappo.cli", "train", "--config", "recipes/cpu/tiny_ppo.yaml",
            f"trainer.default_local_dir={out}", *OVERRIDES]


def _env(tmp: Path) -> dict:
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    return dict(os.environ, HOME=str(home), HF_HOME=str(home / "hf"), MEGAPPO_CPU_THREADS="1")


def _run_until(cmd: list[str], env: dict, log: Path, kill_when, timeout: float = 300) -> str:
    """Run `cmd`; SIGKILL its process group once `kill_when()` is true. Returns 'killed' or 'exited <rc>'."""
    with open(log, "a") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            if kill_when():
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
                return "killed"
            time.sleep(0.005)
        if proc.poll() is None:
            raise AssertionError(f"timed out; log:\n{log.read_text()[-4000:]}")
        return f"exited {proc.returncode}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def _after_row(out: Path, step: int, delay: float):
    seen: list[float] = []

    def ready() -> bool:
        if not seen and any(r.get("step") == step for r in metrics_so_far(out)):
            seen.append(time.monotonic())
        return bool(seen) and time.monotonic() - seen[0] >= delay
    return ready


def _saving(out: Path, step: int):
    return lambda: bool(glob.glob(str(out / "checkpoints" / f"global_step_{step}.tmp-*" / "actor*")))


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: its directory."""
    tmp = tmp_path_factory.mktemp("reference")
    ref = tmp / "uninterrupted"
    subprocess.run(_command(ref), cwd=REPO, env=_env(tmp), check=True, capture_output=True, timeout=600)
    return ref


def _same_run(ref: Path, out: Path) -> None:
    """`out` logged what `ref` logged, step for step, and ended at the same weights."""
    expected, got = metrics_so_far(ref), metrics_so_far(out)
    assert [r["step"] for r in got] == [r["step"] for r in expected] == list(range(STEPS + 1))
    assert_same_rows(expected, got)
    a, b = _weights(ref / "hf" / "actor"), _weights(out / "hf" / "actor")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((out / "run_status.json").read_text())["status"] == "finished"


def test_sigkill_at_any_moment_then_the_same_command_continues_exactly(reference, tmp_path):
    env = _env(tmp_path)
    out = tmp_path / "interrupted"
    step_s = max(r["timing/step_s"] for r in metrics_so_far(reference) if r["step"] > 0)

    log = tmp_path / "interrupted.log"
    cmd = _command(out)
    # mid-step 5 (resumes from step 3, an epoch boundary), then while step 6's checkpoint is being written (the
    # half-written one must be ignored and removed), then mid-step 7 of the process that resumed from step 6
    kills = [_after_row(out, 4, 0.3 * step_s), _saving(out, 6), _after_row(out, 7, 0.5 * step_s)]
    outcomes = [_run_until(cmd, env, log, when) for when in kills]
    assert outcomes == ["killed"] * 3, (outcomes, log.read_text()[-4000:])
    assert _run_until(cmd, env, log, lambda: False) == "exited 0", log.read_text()[-4000:]
    text = log.read_text()
    assert "removed 1 unfinished checkpoint" in text  # the kill during the step-6 save left a .tmp- directory
    assert not glob.glob(str(out / "checkpoints" / "*.tmp-*"))

    _same_run(reference, out)

    # every checkpoint is at an epoch boundary: it resumes at the start of the next epoch
    state = json.loads((out / "checkpoints" / "global_step_3" / "trainer_state.json").read_text())
    assert (state["step"], state["dataloader"]["epoch"], state["dataloader"]["batch_index"]) == (3, 1, 0)
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == str(STEPS)
    assert read_metrics(str(out))[-1]["step"] == STEPS


def _interrupt_after_step_1(cmd, env, out, log, send) -> None:
    """Start the run, `send(proc)` its signal just after step 1's row, and expect exit 75 (the step saved)."""
    with open(log, "a") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        ready = _after_row(out, 1, 0.05)
        deadline = time.monotonic() + 300
        while not ready() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        send(proc)
        assert proc.wait(120) == 75, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


# SIGUSR1 takes SIGTERM's path (preemption.StopRequest); Slurm's SIGUSR1 is tests/cluster/test_slurm.py's: long
@pytest.mark.parametrize("sig", ["SIGTERM", pytest.param("SIGUSR1", marks=pytest.mark.long)])
def test_preemption_signal_saves_exits_75_and_the_same_command_resumes(reference, tmp_path, sig):
    """What Slurm sends before preemption or the time limit: the step in progress finishes, a checkpoint is
    written, the run exits with 75 and says so in run_status.json; started again, it continues exactly."""
    env, out, log = _env(tmp_path), tmp_path / "preempted", tmp_path / "preempted.log"
    cmd = _command(out)
    _interrupt_after_step_1(cmd, env, out, log, lambda proc: proc.send_signal(getattr(signal, sig)))
    status = json.loads((out / "run_status.json").read_text())
    assert status["status"] == "preempted" and sig in status["reason"]
    stopped_at = status["step"]
    assert 1 <= stopped_at < STEPS and metrics_so_far(out)[-1]["step"] == stopped_at
    # the signal came early in the stopped step: its weight sync was skipped (the servers are going down with the
    # job); the resumed run feeds the saved weights to its engine first, so what follows is the same run
    skipped = [r["step"] for r in metrics_so_far(out) if r.get("rollout/weight_sync_skipped")]
    assert skipped == [stopped_at] and metrics_so_far(out)[-1]["rollout/weight_sync_bytes"] == 0.0
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == str(stopped_at)
    assert f"{sig} received" in log.read_text()
    assert subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, timeout=600).returncode == 0
    _same_run(reference, out)


def test_ctrl_c_saves_the_finished_step_exits_75_and_the_same_command_resumes(reference, tmp_path):
    """Ctrl-C in a terminal (SIGINT to the whole process group, helpers included) is taken as SIGTERM: one line
    says so, the step in progress finishes and is saved, no helper prints a traceback, and the same command
    continues exactly, saying where from."""
    env, out, log = _env(tmp_path), tmp_path / "interrupted", tmp_path / "interrupted.log"
    # reward workers and the engine in a process of its own: helpers that a Ctrl-C reaches too
    cmd = _command(out) + ["reward_model.backend=process", "reward_model.num_workers=1",
                           "actor_rollout_ref.hybrid_engine=false"]
    _interrupt_after_step_1(cmd, env, out, log, lambda proc: os.killpg(proc.pid, signal.SIGINT))
    text = log.read_text()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-4000:]
    assert [line for line in text.splitlines() if "Ctrl-C" in line] == [
        "megappo train: Ctrl-C: finishing this step, saving a checkpoint and exiting with 75 (run the same "
        "command to resume); Ctrl-C again stops at once, without saving"]
    status = json.loads((out / "run_status.json").read_text())
    stopped_at = status["step"]
    assert status["status"] == "preempted" and "SIGINT" in status["reason"] and 1 <= stopped_at < STEPS
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == str(stopped_at)
    resumed = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert (f"megappo train: resumed from {out / 'checkpoints' / f'global_step_{stopped_at}'} (step {stopped_at}); "
            f"continuing at step {stopped_at + 1} of {STEPS}") in resumed.stderr
    _same_run(reference, out)


def test_save_before_deadline_stops_in_time(tmp_path):
    out = tmp_path / "deadline"
    # a deadline already close: the first step ends too near it to run another and save
    proc = subprocess.run(_command(out) + [f"trainer.save_before_deadline={time.time() + 5}"], cwd=REPO,
                          env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 75, proc.stderr[-4000:]
    status = json.loads((out / "run_status.json").read_text())
    assert status["status"] == "preempted" and "save_before_deadline" in status["reason"]
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == str(status["step"])


def _limit_file_size(limit: int):
    def preexec():
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        os.setsid()
    return preexec


def test_disk_full_while_saving_names_the_directory_and_keeps_the_previous_checkpoint(tmp_path):
    from megappo.models.checkpoint import verify_checkpoint

    env, out = _env(tmp_path), tmp_path / "full"
    first = _command(out)
    first[first.index(f"trainer.total_training_steps={STEPS}")] = "trainer.total_training_steps=3"
    subprocess.run(first, cwd=REPO, env=env, check=True, capture_output=True, timeout=600)
    ckpts = out / "checkpoints"
    biggest = max(f.stat().st_size for f in (ckpts / "global_step_3").rglob("*") if f.is_file())
    # the resumed run may write everything but a checkpoint file of that size (the disk is "full" for it)
    proc = subprocess.run(_command(out), cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
                          preexec_fn=_limit_file_size(biggest // 2))
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert f"saving the step-6 checkpoint into {ckpts} failed" in proc.stderr
    assert f"the previous checkpoint {ckpts / 'global_step_3'} is intact" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert (ckpts / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert not (ckpts / "global_step_6").exists() and not list(ckpts.glob("*.tmp-*"))
    verify_checkpoint(str(ckpts / "global_step_3" / "actor"))
    # with room again, the same command continues from step 3
    assert subprocess.run(_command(out), cwd=REPO, env=env, capture_output=True, timeout=600).returncode == 0
    assert [r["step"] for r in metrics_so_far(out)] == list(range(STEPS + 1))
