"""Stop requests: the first SIGTERM/SIGUSR1 asks for a checkpoint after the step; a copy of it within the repeat
window (Slurm signals the ranks directly and again through the launch scripts) changes nothing; a later one stops
at once."""
from __future__ import annotations

import os
import signal
import time

import pytest

from megappo.trainer.preemption import StopRequest


@pytest.fixture
def stop():
    request = StopRequest(None, repeat_window_s=0.5)
    request.install()
    yield request
    request.uninstall()


def test_a_copy_of_the_signal_is_not_a_second_request(stop, capfd):
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGUSR1)  # the relayed copy, as another signal
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.signal == "SIGTERM"
    err = capfd.readouterr().err
    assert "saving a checkpoint after this step" in err and err.count("taken as a copy of the first") == 2


def test_a_second_request_after_the_window_stops_at_once(stop):
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.6)
    with pytest.raises(SystemExit) as stopped:
        os.kill(os.getpid(), signal.SIGUSR1)
    assert stopped.value.code == 128 + signal.SIGUSR1


def test_ctrl_c_asks_for_a_checkpoint_and_a_second_one_leaves_at_once():
    """A person's Ctrl-C: the first is a stop request (no KeyboardInterrupt), a relayed copy of it changes nothing,
    and a second press ends the process with 130 and no traceback (os._exit: a SystemExit raised inside a callback
    would be dropped)."""
    import subprocess
    import sys

    code = ("import os, signal, time\n"
            "from megappo.trainer.preemption import StopRequest\n"
            "stop = StopRequest(None); stop.install()\n"
            "os.kill(os.getpid(), signal.SIGINT)\n"
            "print('asked', stop.signal, flush=True)\n"
            "os.kill(os.getpid(), signal.SIGINT)\n"  # a relayed copy: nothing
            "time.sleep(0.5)\n"
            "os.kill(os.getpid(), signal.SIGINT)\n"
            "time.sleep(5); print('still running', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 130 and proc.stdout == "asked SIGINT\n", proc
    assert proc.stderr.splitlines() == [
        "megappo train: Ctrl-C: finishing this step, saving a checkpoint and exiting with 75 (run the same command "
        "to resume); Ctrl-C again stops at once, without saving",
        "megappo train: Ctrl-C again: stopping now, without saving this step (the last checkpoint stays)"]
