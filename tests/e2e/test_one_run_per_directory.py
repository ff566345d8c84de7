"""A run owns its output directory (megappo/trainer/run_lock.py), seen from the command line:

- a second `megappo train` on the directory of a running one exits 1 naming the holder, before and after the first
  one's first checkpoint, on one rank and on two; it reads, writes and removes nothing there (not even a `.tmp-`
  directory of the first one's save in progress), and the first run finishes with every step logged;
- with trainer.dir_lock_wait_s (launch/slurm/*.sbatch: 300) a run waits for a holder that lets go, then trains;
- started again over a finished run it says so and exits 0, writing nothing.

The first run is frozen (SIGSTOP to its process group, checkpoint writers included) while a second one starts,
so "the first is still running" holds however slowly this machine runs; a stopped process still holds its lock, as
a live one does."""
from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megappo.testing.dist import free_port
from megappo.testing.prompts import read_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
STEPS = 6
OVERRIDES = [f"trainer.total_training_steps={STEPS}", "trainer.save_freq=3", "trainer.test_freq=-1",
             "trainer.logger=[]", "data.train_batch_size=16", "data.synthetic.num_train_prompts=64",
             "data.synthetic.num_val_prompts=16", "data.synthetic.warm_start_steps=30",
             "actor_rollout_ref.actor.ppo_mini_batch_size=8"]
RUN_TIMEOUT = 300
SECOND_TIMEOUT = 120  # a refused start: imports and the process group, no model


def _command(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "megappo.cli", "train", "--config", "recipes/cpu/tiny_ppo.yaml",
            f"trainer.default_local_dir={out}", *OVERRIDES, *extra]


def _env(tmp: Path, **extra: str) -> dict:
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    return dict(os.environ, HOME=str(home), HF_HOME=str(home / "hf"), MEGAPPO_CPU_THREADS="1", OMP_NUM_THREADS="1",
                **extra)


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and directory under root: (size, mtime_ns); directories' mtimes change when entries come or go."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            out[str(path.relative_to(root))] = (st.st_size if path.is_file() else 0, st.st_mtime_ns)
    return out


def _wait_for(what: str, ready, proc: subprocess.Popen, log: Path, timeout: float = RUN_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the first run ({'exited ' + str(proc.returncode) if proc.poll() is not None else 'running'})"
                        f" never reached {what}:\n{log.read_text(errors='replace')[-4000:]}")
        time.sleep(0.05)


def _steps(out: Path) -> list[int]:
    return [r["step"] for r in read_metrics(str(out))] if (out / "metrics.jsonl").exists() else []


def _second_one_rank(out: Path, env: dict, *extra: str) -> list[tuple[int, str]]:
    proc = subprocess.run(_command(out, *extra), cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=SECOND_TIMEOUT)
    return [(proc.returncode, proc.stdout + proc.stderr)]


def _second_two_ranks(out: Path, env: dict) -> list[tuple[int, str]]:
    """Two ranks launched the way torchrun launches them, but without its agent (which would end the others
    itself): each rank must leave on its own. Returns each rank's (exit status, output)."""
    port = str(free_port())
    procs = []
    try:
        for rank in range(2):
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            procs.append(subprocess.Popen(_command(out, "trainer.n_gpus_per_node=2"), cwd=REPO, env=rank_env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          start_new_session=True))
        outputs = [p.communicate(timeout=SECOND_TIMEOUT)[0] for p in procs]
        return [(p.returncode, text) for p, text in zip(procs, outputs)]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(30)


def _refused(results: list[tuple[int, str]], first_pid: int) -> None:
    """Every rank exited 1; rank 0 named the holder and the fix, once, with no traceback."""
    text = "\n".join(f"--- rank {i} (exit {rc}):\n{out[-3000:]}" for i, (rc, out) in enumerate(results))
    assert [rc for rc, _ in results] == [1] * len(results), text
    assert f"is in use by another megappo run: pid {first_pid} on {socket.gethostname()}, running since" \
        in results[0][1], text
    assert "trainer.default_local_dir at another directory" in results[0][1], text
    assert sum(out.count("is in use by another megappo run") for _, out in results) == 1, text
    assert all("Traceback" not in out for _, out in results), text


@pytest.mark.multirank  # the second start after the checkpoint runs two ranks
@pytest.mark.timeout(RUN_TIMEOUT + 3 * SECOND_TIMEOUT)
def test_a_second_run_on_a_running_ones_directory_exits_1_and_touches_nothing(tmp_path):
    out, log = tmp_path / "run", tmp_path / "first.log"
    env = _env(tmp_path)
    with open(log, "w") as f:
        first = subprocess.Popen(_command(out), cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    try:
        # 1. before the first checkpoint (step 0's validation row is logged after its start-up clean-up), with
        # resume_mode=disable: a fresh start takes no directory that is in use either
        _wait_for("step 0", lambda: 0 in _steps(out), first, log)
        os.killpg(first.pid, signal.SIGSTOP)  # with its checkpoint writers
        planted = out / "checkpoints" / "global_step_9.tmp-abcd"  # the first run's save in progress, say
        planted.mkdir(parents=True)
        (planted / "common.pt").write_bytes(b"half written")
        before = _tree(out)
        _refused(_second_one_rank(out, env, "trainer.resume_mode=disable"), first.pid)
        assert _tree(out) == before  # nothing removed, written or even created
        os.killpg(first.pid, signal.SIGCONT)

        # 2. after the first checkpoint, two ranks: the other rank learns the outcome from rank 0 and leaves too
        _wait_for("its step-3 checkpoint", lambda: (out / "checkpoints" / "global_step_3").is_dir(), first, log)
        os.killpg(first.pid, signal.SIGSTOP)  # with its checkpoint writers
        before = _tree(out)
        _refused(_second_two_ranks(out, env), first.pid)
        assert _tree(out) == before
        os.killpg(first.pid, signal.SIGCONT)

        assert first.wait(RUN_TIMEOUT) == 0, log.read_text(errors="replace")[-4000:]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait(30)
    rows = read_metrics(str(out))
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    assert all(math.isfinite(r["reward/mean"]) and math.isfinite(r["actor/pg_loss"]) for r in rows[1:])
    assert json.loads((out / "run_status.json").read_text())["step"] == STEPS
    assert (planted / "common.pt").read_bytes() == b"half written"  # removed by no one while its owner ran
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == str(STEPS)


# holds the directory's lock as a run still exiting would, lets go when told (a line on stdin), then lingers
HOLDER = textwrap.dedent("""
    import sys, time
    from megappo.trainer.run_lock import RunLock
    lock = RunLock(sys.argv[1]).acquire()
    print("locked", flush=True)
    sys.stdin.readline()
    lock.release()
    time.sleep(60)
""")


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_with_the_sbatch_wait_a_run_waits_for_the_holder_then_trains(tmp_path):
    """launch/slurm/*.sbatch pass trainer.dir_lock_wait_s=300: a holder that lets go within it delays the run,
    which then trains as usual."""
    out, log = tmp_path / "run", tmp_path / "waiting.log"
    env = _env(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    run = None
    try:
        assert holder.stdout.readline().strip() == "locked"
        with open(log, "w") as f:
            run = subprocess.Popen(_command(out, "trainer.total_training_steps=2", "trainer.dir_lock_wait_s=300"),
                                   cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        _wait_for("the wait", lambda: "waiting up to" in log.read_text(errors="replace"), run, log)
        time.sleep(3)  # it keeps waiting...
        assert run.poll() is None and not (out / "metrics.jsonl").exists()
        holder.stdin.write("go\n")  # ...until the holder lets go
        holder.stdin.flush()
        assert run.wait(RUN_TIMEOUT) == 0, log.read_text(errors="replace")[-4000:]
    finally:
        for proc in (run, holder):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
    text = log.read_text(errors="replace")
    assert f"is in use by another megappo run (pid {holder.pid} on {socket.gethostname()}, running since" in text
    assert "waiting up to 300 s (trainer.dir_lock_wait_s)" in text and "is free now: this run holds it" in text
    assert _steps(out) == [0, 1, 2]
    assert json.loads((out / "run_status.json").read_text())["status"] == "finished"


@pytest.mark.timeout(2 * RUN_TIMEOUT)
def test_starting_a_finished_run_again_says_so_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    env = _env(tmp_path)
    cmd = _command(out, "trainer.total_training_steps=2", "trainer.save_freq=2", "trainer.logger=[tensorboard]")
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, timeout=RUN_TIMEOUT)
    before = _tree(out)
    assert any(name.startswith("tensorboard/") for name in before) and "hf/actor/config.json" in before
    time.sleep(0.05)  # a file rewritten now would get another mtime
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"{out} already finished at step 2 ({out / 'run_status.json'})" in proc.stderr, proc.stderr[-4000:]
    assert "trainer.resume_mode=disable" in proc.stderr and "trainer.default_local_dir" in proc.stderr
    assert "steps, output in" not in proc.stderr  # no model was built, no summary printed
    after = _tree(out)
    # only the lock's own bookkeeping: the holder's name, written and cleared
    assert {k: v for k, v in after.items() if k != ".megappo.lock"} == \
        {k: v for k, v in before.items() if k != ".megappo.lock"}
