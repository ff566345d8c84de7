"""Helpers that job-wide signals cannot stop, without SGLang: the watchdog (`reaper.py --ignore-job-signals`) runs a
stand-in server through `ignore_job_signals.py`; the stand-in installs a SIGTERM handler of its own (as uvicorn and
SGLang's tokenizer manager do) and spawns a child (as SGLang spawns its scheduler) that does too. Slurm's signals to
every one of them leave them running; the parent's stop request ends them all at once."""
import os
import signal
import subprocess
import sys
import time

import pytest

from megappo.platform.job_signals import JOB_SIGNALS, job_signals_blocked
from megappo.rollout.serving.process import REAPER, SHELTER

SERVER = """
import multiprocessing as mp, os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: sys.exit(3))  # what a server's own shutdown handler would do
signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM, signal.SIGINT])  # as multiprocessing's tracker start does
child = mp.get_context("spawn").Process(target=time.sleep, args=(600,))
child.start()
print("ready", os.getpid(), child.pid, flush=True)
time.sleep(600)
"""


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


def _masks(pid: int) -> tuple[int, int]:
    fields = dict(line.split(":\t", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":\t" in line)
    return int(fields["SigBlk"], 16), int(fields["SigIgn"], 16)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("launcher", ["-c", "FILE.py"])  # SGLang's `-m`/`-c` launchers, vLLM's launch.py by path
def test_job_wide_signals_leave_the_helper_tree_running_and_the_parents_stop_ends_it(launcher, tmp_path):
    program = ["-c", SERVER]
    if launcher == "FILE.py":
        (tmp_path / "server.py").write_text(SERVER)
        program = [str(tmp_path / "server.py")]
    with job_signals_blocked():
        watchdog = subprocess.Popen(
            [sys.executable, "-I", REAPER, str(os.getpid()), "--grace", "15", "--ignore-job-signals", "--",
             sys.executable, SHELTER, *program], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            start_new_session=True)
    try:
        line = watchdog.stdout.readline().decode().split()
        assert line[:1] == ["ready"], line
        server, child = int(line[1]), int(line[2])
        tree = [watchdog.pid, server, child]
        wanted = sum(1 << (int(s) - 1) for s in JOB_SIGNALS)
        for pid in tree:
            blocked, ignored = _masks(pid)
            assert blocked & wanted == wanted and ignored & wanted == wanted, (pid, hex(blocked), hex(ignored))
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGTERM):
            for pid in tree:
                os.kill(pid, sig)
        time.sleep(1)
        # none died, exited or stopped (asleep, or running for a moment on a loaded machine)
        assert all(_state(pid) in ("S", "R") for pid in tree), [_state(pid) for pid in tree]
        assert watchdog.poll() is None

        t0 = time.monotonic()
        watchdog.stdin.write(b"stop\n")
        watchdog.stdin.close()
        assert watchdog.wait(10) == 0
        seconds = time.monotonic() - t0
        deadline = time.monotonic() + 5
        while any(_state(pid) not in ("gone", "Z") for pid in tree[1:]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(_state(pid) in ("gone", "Z") for pid in tree[1:]), [_state(pid) for pid in tree]
        assert seconds < 5, f"stopping took {seconds:.1f} s: it must not wait out a grace period for SIGTERM"
    finally:
        if watchdog.poll() is None:
            watchdog.kill()
            watchdog.wait()
