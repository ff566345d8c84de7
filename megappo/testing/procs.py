"""Waiting for processes in tests."""
from __future__ import annotations

import time


def process_gone(pid: int, within: float) -> bool:
    """True once process `pid` no longer runs (gone, or a zombie waiting for its parent), polling for `within` s."""
    import psutil

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def kill_a_server_after_step_1(out_dir, marker: str, killed: dict, timeout: float = 600) -> None:
    """Once the run in `out_dir` has logged step 1, SIGKILL the process group of the last server among this
    process's descendants whose command line holds `marker` (not its watchdog, nor a server that was running before
    this was called), as a crash or the OOM killer would;
    `killed["port"]` is its port. Returns without killing when `killed["stop"]` is set or `timeout` passes first
    (run it in a thread beside the trainer)."""
    import json
    import os
    import signal
    import time

    import psutil

    def servers() -> list:
        return [p for p in psutil.Process().children(recursive=True)
                if marker in " ".join(p.cmdline()) and "reaper.py" not in " ".join(p.cmdline())]

    older = {p.pid for p in servers()}  # a session's own server (a test fixture's) is not the run's to kill
    deadline = time.time() + timeout
    while time.time() < deadline and not killed.get("stop"):
        try:
            with open(os.path.join(out_dir, "metrics.jsonl")) as f:
                if any(json.loads(line)["step"] == 1 for line in f if line.strip()):
                    break
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.2)
    else:
        return
    victim = [p for p in servers() if p.pid not in older][-1]
    killed["port"] = victim.cmdline()[victim.cmdline().index("--port") + 1]
    os.killpg(victim.pid, signal.SIGKILL)
