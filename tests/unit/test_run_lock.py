"""megappo/trainer/run_lock.py between real processes: a held directory refuses a second run naming the holder, a
SIGKILLed holder frees it, a bounded wait succeeds when the holder lets go in time and fails naming it when it does
not; and when a directory counts as finished."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megappo.config import ConfigError
from megappo.trainer.run_lock import LOCK_FILE, DirLocked, RunLock, finished_message

# a holder in its own process (POSIX locks never conflict within one): locks, says so, holds for HOLD_S seconds
HOLDER = textwrap.dedent("""
    import sys, time
    from megappo.trainer.run_lock import RunLock
    lock = RunLock(sys.argv[1]).acquire()
    print("locked", flush=True)
    time.sleep(float(sys.argv[2]))
    lock.release()
    print("released", flush=True)
    time.sleep(float(sys.argv[3]) if len(sys.argv) > 3 else 0)
""")


@pytest.fixture
def holder(tmp_path):
    """Start holders with holder(dir, hold_s); each is killed at the end of the test."""
    procs: list[subprocess.Popen] = []

    def start(directory: Path, hold_s: float, linger_s: float = 0.0) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory), str(hold_s), str(linger_s)],
                                stdout=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        procs.append(proc)
        assert proc.stdout.readline().strip() == "locked"  # the holder holds it from here on
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_a_held_directory_refuses_a_second_run_naming_the_holder(tmp_path, holder):
    proc = holder(tmp_path, 60)
    t0 = time.monotonic()
    with pytest.raises(DirLocked) as e:
        RunLock(str(tmp_path)).acquire(wait_s=0)
    assert time.monotonic() - t0 < 5  # no wait by default
    message = str(e.value)
    assert isinstance(e.value, ConfigError)  # `megappo train` prints it and exits 1
    assert f"pid {proc.pid} on {socket.gethostname()}" in message
    assert "running since 20" in message  # the ISO start time
    assert f"kill {proc.pid}" in message and "trainer.default_local_dir" in message
    assert "trainer.dir_lock_wait_s" in message
    info = json.loads((tmp_path / LOCK_FILE).read_text())
    assert info["pid"] == proc.pid and info["host"] == socket.gethostname()
    assert proc.poll() is None  # the holder is untouched


def test_a_sigkilled_holder_frees_the_directory(tmp_path, holder):
    proc = holder(tmp_path, 60)
    assert not RunLock(str(tmp_path)).try_acquire()
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    lock = RunLock(str(tmp_path)).acquire(wait_s=0)  # the kernel dropped the dead process's lock
    try:
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    finally:
        lock.release()
    assert (tmp_path / LOCK_FILE).read_text() == ""  # no stale name once released


def test_the_bounded_wait_succeeds_when_the_holder_lets_go_in_time(tmp_path, holder, capfd):
    holder(tmp_path, 2.0, linger_s=30)  # lets go after 2 s but keeps running (a process still exiting)
    t0 = time.monotonic()
    lock = RunLock(str(tmp_path)).acquire(wait_s=30, poll_s=0.2)
    waited = time.monotonic() - t0
    lock.release()
    assert 1.0 < waited < 15, waited
    err = capfd.readouterr().err
    assert "is in use by another megappo run (pid" in err and "waiting up to" in err
    assert "is free now: this run holds it" in err


def test_the_bounded_wait_fails_naming_the_holder_after_the_wait(tmp_path, holder):
    proc = holder(tmp_path, 60)
    t0 = time.monotonic()
    with pytest.raises(DirLocked, match=f"pid {proc.pid} on .*waited [12] s for it"):
        RunLock(str(tmp_path)).acquire(wait_s=1.5, poll_s=0.2)
    assert 1.4 < time.monotonic() - t0 < 10


def test_release_is_idempotent_and_the_lock_can_be_taken_again(tmp_path):
    lock = RunLock(str(tmp_path / "new" / "dir")).acquire()  # creates the directory
    lock.release()
    lock.release()
    with RunLock(str(tmp_path / "new" / "dir")).acquire() as again:
        assert again.held
    assert (tmp_path / "new" / "dir" / LOCK_FILE).exists()  # never removed (two runs could lock two files)


def _finished_dir(tmp_path: Path, status: str = "finished", step: int = 4, checkpoint: int | None = 4) -> str:
    (tmp_path / "run_status.json").write_text(json.dumps({"status": status, "step": step, "time": 0}))
    if checkpoint is not None:
        ckpt = tmp_path / "checkpoints" / f"global_step_{checkpoint}"
        ckpt.mkdir(parents=True)
        (ckpt / "trainer_state.json").write_text("{}")
        (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").write_text(str(checkpoint))
    return str(tmp_path)


@pytest.mark.parametrize("status,step,checkpoint,total,finished", [
    ("finished", 4, 4, 4, True),
    ("finished", 4, None, 4, True),  # save_freq=-1: no checkpoints, the status alone says it
    ("finished", 4, 4, None, True),  # total not known yet
    ("finished", 4, 4, 6, False),  # a larger total_training_steps: train on from the checkpoint
    ("finished", 4, 2, 4, False),  # the newest checkpoint is not the end: something else went on
    ("preempted", 4, 4, 8, False),
    ("stopped", 4, 4, 4, False),
])
def test_when_a_directory_counts_as_finished(tmp_path, status, step, checkpoint, total, finished):
    message = finished_message(_finished_dir(tmp_path, status, step, checkpoint), total)
    assert (message is not None) == finished
    if finished:
        assert f"already finished at step {step} (" in message and "run_status.json" in message
        assert "trainer.default_local_dir" in message and "trainer.resume_mode=disable" in message


def test_no_status_file_is_not_finished(tmp_path):
    assert finished_message(str(tmp_path), 4) is None
    (tmp_path / "run_status.json").write_text("{not json")
    assert finished_message(str(tmp_path), 4) is None


def test_a_filesystem_without_locks_warns_and_goes_on(tmp_path, monkeypatch, capfd):
    """NFS mounted with nolock answers ENOLCK: refusing would leave no way to train there, so the run warns."""
    import errno

    from megappo.trainer import run_lock

    def no_locks(*_args):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(run_lock.fcntl, "lockf", no_locks)
    lock = RunLock(str(tmp_path)).acquire(wait_s=0)
    lock.release()
    assert "cannot be locked" in capfd.readouterr().err


def test_the_message_names_no_empty_way_to_stop_an_unknown_holder(tmp_path, monkeypatch):
    lock = RunLock(str(tmp_path))
    monkeypatch.setattr(lock, "holder", lambda: None)  # locked, host and pid not written yet
    message = lock.locked_message(0)
    assert "()" not in message and "Wait for it to finish or stop it and start again" in message
    monkeypatch.setattr(lock, "holder", lambda: {"slurm_job": "42"})
    assert "or stop it (`scancel 42`) and start again" in lock.locked_message(0)
    monkeypatch.setattr(lock, "holder", lambda: {"pid": 7, "host": "n1", "slurm_job": "42"})
    assert "stop it (`kill 7` on n1, or `scancel 42`) and start" in lock.locked_message(0)
