"""A watchdog between megappo and an SGLang server: the server never outlives the process that started it.

    python -I reaper.py PARENT_PID [--grace S] [--ignore-job-signals] [--remove DIR] -- python -m sglang.launch_server ...

`python -m sglang.launch_server` forks its own children (scheduler, detokenizer, ...), and the kernel's parent-death
signal (prctl PR_SET_PDEATHSIG) only reaches a direct child, so a signal sent to the server alone can leave them
running, holding the port and the GPU memory. This watchdog runs the server in a process group of its own and kills
that whole group (SIGTERM, then SIGKILL after `--grace` seconds) when

- it gets SIGTERM or SIGINT, or, with --ignore-job-signals, a line or EOF on its stdin (`SGLangServer.stop()`),
- its parent dies, however it dies (SIGKILL included): the kernel sends it SIGHUP (its PR_SET_PDEATHSIG), and a
  poll of getppid() every half second covers what that misses (a non-Linux kernel, the parent dying before prctl),
- the server exits by itself (its stragglers go too); the watchdog then exits with the server's code.

PR_SET_PDEATHSIG fires when the *thread* that started this process exits, not only the process (a server started
from a worker thread, as tools/sglang/check.py does), so SIGHUP only stops the server once getppid() shows that the
parent is really gone. The server itself gets PR_SET_PDEATHSIG=SIGKILL towards this watchdog, for the one case where
the watchdog cannot clean up: it was SIGKILLed itself.

--ignore-job-signals: the server is its parent's helper, which alone decides when it stops. Slurm signals every
process of a job step (preemption's SIGTERM, `--signal` and `scancel --signal [--full]`, srun's Ctrl-C as SIGINT),
and a server that died of it could not serve the step its trainer finishes before saving. This watchdog then ignores
SIGTERM, SIGINT and SIGUSR1, and runs the server with them ignored and blocked: a disposition is inherited across
exec and by the server's own children (scheduler, detokenizer), and a blocked signal stays undelivered even after
SGLang installs its handlers for it (uvicorn and the tokenizer manager do; `ignore_job_signals.py`, which runs the
server, keeps them ignored and blocked). The watchdog was started with them blocked too (`job_signals_blocked`), so
none reaches it before it ignores them. Stopping such a server is SIGKILL to its process group but the
multiprocessing resource tracker, which cleans up after them (shared memory, semaphores) and leaves; SGLang stops
its own processes with SIGKILL too. Whatever is left after `--grace` seconds gets SIGKILL.

--remove DIR: a folder removed once the server's group is gone, however it went (the server's private TMPDIR: vLLM
leaves its `vllm_dist_<uuid>` rendezvous file there, and a killed server removes nothing).

Standard library only: it runs with SGLang's python (`python -I` keeps megappo and the caller's environment out of
its sys.path). Its own lines in the log start with "megappo-reaper:".
"""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
POLL_S = 0.5
JOB_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)  # what Slurm sends every process of a job step


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


def _group_members(pgid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the live (not zombie) processes in group `pgid`: a zombie holds nothing but its pid,
    and waiting for init to reap it would only slow the stop down."""
    members = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid or fields[0] in ("Z", "X"):
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                members.append((int(pid), f.read().replace(b"\0", b" ").decode(errors="replace")))
        except (OSError, IndexError, ValueError):
            continue
    return members


def _group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process is in group `pgid`."""
    if os.path.isdir("/proc/self"):
        return bool(_group_members(pgid))
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we cannot signal still exists
        return True


def _kill_all_but_tracker(pgid: int) -> None:
    """SIGKILL every process of the group but multiprocessing's resource tracker, which then cleans up after them
    (shared memory, semaphores) and exits by itself: its pipe's last writer is gone."""
    if not os.path.isdir("/proc/self"):
        os.killpg(pgid, signal.SIGKILL)
        return
    members = _group_members(pgid)
    if not members:
        raise ProcessLookupError(pgid)
    for pid, cmd in members:
        if "multiprocessing.resource_tracker" not in cmd:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def kill_group(child: subprocess.Popen, grace: float, immune: bool = False) -> None:
    """SIGTERM the child's process group (`immune`, a server that ignores SIGTERM: SIGKILL to all of it but the
    resource tracker), SIGKILL whatever is left after `grace` seconds, reap the child."""
    pgid = child.pid  # the child leads its own group (start_new_session)
    if immune:
        steps = [(lambda: _kill_all_but_tracker(pgid), grace, "SIGKILL to all but the resource tracker")]
    else:
        steps = [(lambda: os.killpg(pgid, signal.SIGTERM), grace, "SIGTERM")]
    steps.append((lambda: os.killpg(pgid, signal.SIGKILL), 5.0, "SIGKILL"))
    for send, wait, what in steps:
        try:
            send()
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
            _say(f"process group {pgid} still alive {wait:.0f} s after {what}")
            continue
        break
    try:
        child.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _child_setup() -> None:
    # runs in the server's process between fork and exec: dies with this watchdog, even if it is SIGKILLed
    set_parent_death_signal(signal.SIGKILL)


def _stop_requested() -> bool:
    """Whether stdin (a pipe from the parent) has a line or EOF: the stop request of --ignore-job-signals. A pipe,
    not a signal, because every signal but SIGKILL may come job-wide."""
    import select

    try:
        ready, _, _ = select.select([sys.stdin], [], [], 0)
    except (OSError, ValueError):
        return False
    return bool(ready)


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") < 1 or argv.index("--") == len(argv) - 1:
        print("usage: reaper.py PARENT_PID [--grace S] [--ignore-job-signals] [--remove DIR] -- CMD...",
              file=sys.stderr)
        return 2
    sep = argv.index("--")
    opts, cmd = argv[:sep], argv[sep + 1:]
    remove = opts[opts.index("--remove") + 1] if "--remove" in opts else None
    try:
        return _watch(opts, cmd)
    finally:
        if remove:
            shutil.rmtree(remove, ignore_errors=True)


def _watch(opts: list[str], cmd: list[str]) -> int:
    parent = int(opts[0])
    grace = float(opts[opts.index("--grace") + 1]) if "--grace" in opts else 15.0
    immune = "--ignore-job-signals" in opts

    stop_reason: list[str] = []
    if immune:
        for sig in JOB_SIGNALS:  # ignored, and still blocked (as the parent started this): the server inherits both
            signal.signal(sig, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_BLOCK, JOB_SIGNALS)
    else:
        signal.signal(signal.SIGTERM, lambda s, f: stop_reason.append("SIGTERM"))
        signal.signal(signal.SIGINT, lambda s, f: stop_reason.append("SIGINT"))
    signal.signal(signal.SIGHUP, lambda s, f: None)  # the parent-death signal: only wakes the getppid check
    set_parent_death_signal(signal.SIGHUP)
    if os.getppid() != parent:  # it died before prctl took effect
        _say(f"parent {parent} is gone before the server started")
        return 1

    # the server's stdin: /dev/null, not the parent's stop pipe
    child = subprocess.Popen(cmd, start_new_session=True, preexec_fn=_child_setup,
                             stdin=subprocess.DEVNULL if immune else None)
    _say(f"server pid {child.pid} (process group {child.pid}), parent {parent}")
    while True:
        try:
            code = child.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            code = None
        if code is not None:
            _say(f"server exited with code {code}")
            kill_group(child, grace=1.0, immune=immune)  # its children, if it left any
            return code if code >= 0 else 128 - code
        if os.getppid() != parent:
            stop_reason.append(f"parent {parent} died")
        if immune and _stop_requested():
            stop_reason.append("asked by the parent")
        if stop_reason:
            _say(f"stopping the server ({stop_reason[0]})")
            kill_group(child, grace, immune)
            _say("server stopped")
            return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
