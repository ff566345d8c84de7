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
