"""Run a Python program (`-m MODULE`, `-c CODE` or `FILE.py`, then its arguments) that job-wide signals cannot reach:

    python ignore_job_signals.py -m sglang.launch_server --model-path ...

A rollout server is its trainer's helper, and only the trainer stops it (through its watchdog,
`megappo/platform/reaper.py`, with SIGKILL). Slurm signals every process of a job step, though (preemption's
SIGTERM, `--signal`, `scancel --signal [--full]`, srun's SIGINT), so this process and everything it starts ignore
SIGTERM, SIGINT and SIGUSR1, and keep them blocked (the watchdog starts it so). SIG_IGN alone would not last: SGLang
installs its own handlers for them (uvicorn's, the tokenizer manager's, through signal.signal and asyncio/uvloop's
add_signal_handler), and multiprocessing's resource tracker unblocks SIGINT and SIGTERM in the process that starts
it. So `signal.signal` leaves these three ignored and `signal.pthread_sigmask` leaves them blocked, here and in
every child SGLang spawns: a spawned child runs this file again as its `__mp_main__` (it is the main script), and
inherits the blocked mask and SIG_IGN besides.

Standard library only, for the server's own python; its directory is taken off sys.path (megappo's module names
must not shadow the server's).
"""
from __future__ import annotations

import os
import runpy
import signal
import sys

JOB_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or os.curdir) == _HERE:
    del sys.path[0]


def ignore_job_signals() -> None:
    """Ignore and block JOB_SIGNALS in this process for good (idempotent)."""
    if getattr(signal.signal, "_megappo_guard", False):
        return
    real_signal, real_mask = signal.signal, signal.pthread_sigmask
    for sig in JOB_SIGNALS:
        real_signal(sig, signal.SIG_IGN)
    real_mask(signal.SIG_BLOCK, JOB_SIGNALS)

    def guarded_signal(signalnum, handler):
        if signalnum in JOB_SIGNALS:
            return signal.SIG_IGN  # the previous handler, as far as the caller can restore it
        return real_signal(signalnum, handler)

    def guarded_mask(how, mask):
        mask = set(mask)
        if how == signal.SIG_UNBLOCK:
            mask -= set(JOB_SIGNALS)
        elif how == signal.SIG_SETMASK:
            mask |= set(JOB_SIGNALS)
        return real_mask(how, mask)

    guarded_signal._megappo_guard = True  # type: ignore[attr-defined]
    signal.signal, signal.pthread_sigmask = guarded_signal, guarded_mask


ignore_job_signals()  # at import: also in a spawned child, which runs this file as its __mp_main__


def main(argv: list[str]) -> int:
    if argv and argv[0].endswith(".py"):  # a launcher run by path (vLLM's): as `-c` with its file's code
        with open(argv[0]) as f:
            code = compile(f.read(), argv[0], "exec")
        sys.argv = list(argv)
        exec(code, {"__name__": "__main__", "__file__": argv[0], "__builtins__": __builtins__})
        return 0
    if len(argv) < 2 or argv[0] not in ("-m", "-c"):
        print("usage: ignore_job_signals.py (-m MODULE | -c CODE | FILE.py) [ARG...]", file=sys.stderr)
        return 2
    how, what, args = argv[0], argv[1], argv[2:]
    if how == "-c":
        sys.argv = ["-c", *args]
        exec(compile(what, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    else:
        sys.argv = [what, *args]
        # alter_sys=False: sys.modules["__main__"] stays this file, which spawned children then run first
        runpy.run_module(what, run_name="__main__", alter_sys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
