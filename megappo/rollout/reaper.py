"""A watchdog between megappo and an SGLang server: the server never outlives the process that started it.

    python -I reaper.py PARENT_PID [--grace S] -- python -m sglang.launch_server ...

`python -m sglang.launch_server` forks its own children (scheduler, detokenizer, ...), and the kernel's parent-death
signal (prctl PR_SET_PDEATHSIG) only reaches a direct child, so a signal sent to the server alone can leave them
running, holding the port and the GPU memory. This watchdog runs the server in a process group of its own and kills
that whole group (SIGTERM, then SIGKILL after `--grace` seconds) when

- it gets SIGTERM or SIGINT (`SGLangServer.stop()`),
- its parent dies, however it dies (SIGKILL included): the kernel sends it SIGHUP (its PR_SET_PDEATHSIG), and a
  poll of getppid() every half second covers what that misses (a non-Linux kernel, the parent dying before prctl),
- the server exits by itself (its stragglers go too); the watchdog then exits with the server's code.

PR_SET_PDEATHSIG fires when the *thread* that started this process exits, not only the process (a server started
from a worker thread, as tools/sglang/check.py does), so SIGHUP only stops the server once getppid() shows that the
parent is really gone. The server itself gets PR_SET_PDEATHSIG=SIGKILL towards this watchdog, for the one case where
the watchdog cannot clean up: it was SIGKILLed itself.

Standard library only: it runs with SGLang's python (`python -I` keeps megappo and the caller's environment out of
its sys.path). Its own lines in the log start with "megappo-reaper:".
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
POLL_S = 0.5


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send `sig` to this process when its parent (thread) dies; False where there is no prctl."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _say(msg: str) -> None:
    print(f"megappo-reaper: {msg}", file=sys.stderr, flush=True)


def _group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process is in group `pgid`: a zombie holds nothing but its pid, and waiting for
    init to reap it would only slow the stop down."""
    if os.path.isdir("/proc/self"):
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                return True
        return False
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we cannot signal still exists
        return True


def kill_group(child: subprocess.Popen, grace: float) -> None:
    """SIGTERM the child's process group, SIGKILL whatever is left after `grace` seconds, reap the child."""
    pgid = child.pid  # the child leads its own group (start_new_session)
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            child.poll()
            # the children of the server are reaped by init once the server is gone; until then they still count
            if child.returncode is not None and not _group_alive(pgid):
                break
            time.sleep(0.1)
        else:
            _say(f"process group {pgid} still alive {wait:.0f} s after signal {int(sig)}")
            continue
        break
    try:
        child.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _child_setup() -> None:
    # runs in the server's process between fork and exec: dies with this watchdog, even if it is SIGKILLed
    set_parent_death_signal(signal.SIGKILL)


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") < 1 or argv.index("--") == len(argv) - 1:
        print("usage: reaper.py PARENT_PID [--grace S] -- CMD...", file=sys.stderr)
        return 2
    sep = argv.index("--")
    opts, cmd = argv[:sep], argv[sep + 1:]
    parent = int(opts[0])
    grace = float(opts[opts.index("--grace") + 1]) if "--grace" in opts else 15.0

    stop_reason: list[str] = []
    signal.signal(signal.SIGTERM, lambda s, f: stop_reason.append("SIGTERM"))
    signal.signal(signal.SIGINT, lambda s, f: stop_reason.append("SIGINT"))
    signal.signal(signal.SIGHUP, lambda s, f: None)  # the parent-death signal: only wakes the getppid check
    set_parent_death_signal(signal.SIGHUP)
    if os.getppid() != parent:  # it died before prctl took effect
        _say(f"parent {parent} is gone before the server started")
        return 1

    child = subprocess.Popen(cmd, start_new_session=True, preexec_fn=_child_setup)
    _say(f"server pid {child.pid} (process group {child.pid}), parent {parent}")
    while True:
        try:
            code = child.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            code = None
        if code is not None:
            _say(f"server exited with code {code}")
            kill_group(child, grace=1.0)  # its children, if it left any
            return code if code >= 0 else 128 - code
        if os.getppid() != parent:
            stop_reason.append(f"parent {parent} died")
        if stop_reason:
            _say(f"stopping the server ({stop_reason[0]})")
            kill_group(child, grace)
            _say("server stopped")
            return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
