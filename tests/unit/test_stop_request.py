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
