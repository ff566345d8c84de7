"""Run untrusted Python code under limits: the sandbox behind the built-in Python tool.

`Sandbox(limits).run(code)` runs `code` in a process of its own and returns a `RunResult` (output, exit, what
limit it hit). Thread-safe: calls from several threads run at once, each in its own process. The work is done by a
zygote (`_zygote/zygote.py`, standard library only, started with `python -I`); "The sandboxed Python tool" in
docs/agents-and-environments.md says what each call gets. In short, per call:

- file system: an allow-list root (`_zygote/root.py`): the interpreter's own directories, the system's /usr, /lib*,
  /bin, /sbin, generated /etc files, /dev's null, zero, full, random, urandom, the call's /proc, its own tmpfs
  /tmp (`disk_mb`; working directory /tmp/work, HOME, TMPDIR, /dev/shm), and the `readable_paths` the config
  names, all read-only but /tmp; nothing else of the machine;
- namespaces of its own: mount, PID, IPC, network (no interface up), UTS, and a nested user namespace in which the
  code is uid 1000, without capabilities (bounding set empty), under no_new_privs; as root the call also runs as
  an unprivileged uid of its own (from the zygote's slice of `UID_SPACE`), so RLIMIT_NPROC counts its processes;
- a seccomp filter (`_zygote/seccomp.py`) refusing new namespaces, mounts, keyrings, bpf, ptrace, io_uring, ...;
- a fresh session keyring; oom_score_adj 1000;
- memory: one memory cgroup per call slot (`_zygote/cgroup.py`), `memory_mb` in all, where the host allows one
  (`state["memory"]` says which bound held); RLIMIT_AS per process as well;
- CPU time, file size, open files, processes per call (rlimits), wall time and output caps (the supervisor);
- the zygote never holds a call's code or output: each call's supervisor reads its request after the fork.

Where it cannot isolate, starting raises `SandboxUnavailable` saying why, unless the config accepts it:
`allow_network_unsandboxed`, `allow_filesystem_unsandboxed` (the code runs as this process's user in a temporary
directory under the machine's /tmp, removed afterwards) and `allow_syscalls_unfiltered` (no seccomp filter: a
machine other than x86_64 and aarch64, or a kernel without seccomp filters).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

logger = logging.getLogger(__name__)
_ZYGOTE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_zygote", "zygote.py")
_START_TIMEOUT_S = 30.0
_ANSWER_GRACE_S = 5.0
_ZYGOTE_ENV = ("PATH", "LANG", "LC_ALL", "TZ", "LD_LIBRARY_PATH")  # what an interpreter may need to start
MAX_REQUEST_BYTES = 100 * 1024  # code + limits: a model's code past this is a runaway generation, not a program
# root mode: the calls' uids. Each zygote takes a slice of UID_SLICE uids at UID_SPACE + (its pid mod 2^22) x
# UID_SLICE (below 2^31: some tools read uids as signed), so no two live zygotes share a uid.
UID_SPACE, UID_SLICE = 1_000_000_000, 256
_warned_memory = False


class SandboxUnavailable(RuntimeError):
    """The machine does not allow the isolation asked for."""


@dataclass
class Limits:
    timeout_s: float = 10.0  # wall time of one call
    cpu_s: int = 10  # CPU seconds (all the call's threads; each process has its own count)
    memory_mb: int = 1024  # the call's memory in all (its memory cgroup); also each process's address space
    max_processes: int = 16  # processes (and threads) of the call at once, the first one included
    max_file_mb: int = 64  # largest file the code may write
    disk_mb: int = 128  # the call's tmpfs (working directory and /dev/shm) in all
    max_open_files: int = 64
    keep_bytes: int = 64 * 1024  # of each of stdout and stderr: the head and the tail kept
    max_output_bytes: int = 4 << 20  # stdout + stderr past which the code is stopped

    def as_request(self) -> dict:
        d = dict(self.__dict__)
        for key in ("cpu_s", "memory_mb", "max_processes", "max_file_mb", "disk_mb", "max_open_files"):
            d[key] = max(1, int(d[key]))
        return d


@dataclass
class RunResult:
    stdout: str = ""
    stderr: str = ""
    exit_code: Optional[int] = None  # None: killed by a signal (or no answer)
    signal: Optional[int] = None
    timed_out: bool = False  # past timeout_s
    output_limited: bool = False  # stopped past max_output_bytes
    memory_limited: bool = False  # the call's memory cgroup killed a process of it (past memory_mb in all)
    stdout_bytes: int = 0  # all it wrote, kept or not
    stderr_bytes: int = 0
    cpu_s: float = 0.0
    run_s: float = 0.0  # from the runner's fork to its end
    setup_s: float = 0.0  # supervisor's share before the code runs (namespaces, tmpfs, cgroup, pipes)
    latency_s: float = 0.0  # the caller's round trip
    error: Optional[str] = None  # the sandbox itself failed (not the code)


class Sandbox:
    """A zygote process isolated once; `run` asks it for one call. `close()` (or the trainer's death) ends it and
    every call in flight. `readable_paths`: files or directories of the machine the code may read (bound read-only
    at their paths; none by default)."""

    def __init__(self, limits: Optional[Limits] = None, allow_network_unsandboxed: bool = False,
                 allow_filesystem_unsandboxed: bool = False, uid_base: int = UID_SPACE, uid_count: int = UID_SLICE,
                 python: Optional[str] = None, readable_paths: Sequence[str] = (),
                 allow_syscalls_unfiltered: bool = False):
        self.limits = limits or Limits()
        self.allow_network_unsandboxed = allow_network_unsandboxed
        self.allow_filesystem_unsandboxed = allow_filesystem_unsandboxed
        self.allow_syscalls_unfiltered = allow_syscalls_unfiltered
        self.uid_base, self.uid_count = uid_base, uid_count
        self.readable_paths = [os.path.abspath(str(p)) for p in readable_paths]
        missing = [p for p in self.readable_paths if not os.path.exists(p)]
        if missing:
            raise ValueError(f"readable_paths that do not exist: {missing}")
        self.python = python or sys.executable  # the code's interpreter: the venv's, with its packages
        self._lock = threading.Lock()
        self._proc: Optional[subprocess.Popen] = None
        self._ctrl: Optional[socket.socket] = None
        self.state: dict = {}

    # --- life cycle -------------------------------------------------------------------------------------------
    def start(self) -> "Sandbox":
        with self._lock:
            self._start_locked()
        return self

    def _start_locked(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        if self._ctrl is not None:  # a zygote that died: its socket goes with it
            self._ctrl.close()
            self._ctrl = None
        if not sys.platform.startswith("linux"):
            if not (self.allow_network_unsandboxed and self.allow_filesystem_unsandboxed):
                raise SandboxUnavailable(f"the sandbox needs Linux namespaces ({sys.platform}); set "
                                         "allow_network_unsandboxed and allow_filesystem_unsandboxed to run code "
                                         "with limits only")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cfg = {"net": True, "fs": True, "uid_space": self.uid_base, "uid_count": self.uid_count,
               "readable": self.readable_paths, "disk_mb": max(1, int(self.limits.disk_mb))}
        cmd = [self.python, "-I", _ZYGOTE, str(theirs.fileno()), json.dumps(cfg)]
        # A clean environment: a process's first environment stays readable in /proc/self/environ after
        # os.environ is cleared, and the trainer's may hold secrets (API keys).
        env = {k: v for k, v in os.environ.items() if k in _ZYGOTE_ENV}
        proc = subprocess.Popen(cmd, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                start_new_session=True, close_fds=True, env=env)
        theirs.close()
        try:
            line = _read_line(proc, _START_TIMEOUT_S)
            state = json.loads(line)
        except (ValueError, TimeoutError) as e:
            _kill(proc)
            ours.close()
            raise SandboxUnavailable(f"the sandbox's zygote did not start: {e}") from None
        problems = self._problems(state)
        if problems:
            ours.close()
            _kill(proc)
            why = "; ".join(state.get("why") or [])
            raise SandboxUnavailable(f"refusing to start the Python sandbox: {'; '.join(problems)}. "
                                     f"Why: {why or 'unknown'}")
        self._proc, self._ctrl, self.state = proc, ours, state
        _warn_memory(state)

    def _problems(self, state: dict) -> list[str]:
        problems = []
        if not state["net"] and not self.allow_network_unsandboxed:
            problems.append("no network namespace, so the code could reach the network (set "
                            "allow_network_unsandboxed: true to accept that)")
        if not state["fs"] and not self.allow_filesystem_unsandboxed:
            problems.append("no allow-list root in a mount namespace of its own, so the code could read and write "
                            "what this process's user can (set allow_filesystem_unsandboxed: true to accept that)")
        if not state.get("filter") and not self.allow_syscalls_unfiltered:
            problems.append("no seccomp filter, so the code could make namespaces, mounts and keyrings of its own "
                            "(set allow_syscalls_unfiltered: true to accept that)")
        return problems

    def close(self) -> None:
        """End the zygote; it kills every call in flight (and their processes) before it exits."""
        with self._lock:
            proc, ctrl, self._proc, self._ctrl = self._proc, self._ctrl, None, None
        if ctrl is not None:
            ctrl.close()  # EOF: the zygote stops its calls and exits
        if proc is not None:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _kill(proc)
            if proc.stdout:
                proc.stdout.close()

    def __getstate__(self) -> dict:
        """Pickled (to a Ray actor) as its settings: the copy starts a zygote of its own at its first call."""
        d = dict(self.__dict__)
        d.update(_proc=None, _ctrl=None, _lock=None, state={})
        return d

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(d)
        self._lock = threading.Lock()

    def __enter__(self) -> "Sandbox":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def zygote_pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    # --- calls ------------------------------------------------------------------------------------------------
    def run(self, code: str, limits: Optional[Limits] = None) -> RunResult:
        """Run `code`; never raises for what the code does. A sandbox failure is `RunResult.error`."""
        limits = limits or self.limits
        t0 = time.monotonic()
        msg = json.dumps({"code": code, "limits": limits.as_request()}).encode()
        if len(msg) > MAX_REQUEST_BYTES:
            return RunResult(error=f"the code is {len(code.encode())} bytes; the limit is {MAX_REQUEST_BYTES - 1024}")
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            for attempt in range(2):  # a zygote that died (killed from outside) is started again once
                with self._lock:
                    self._start_locked()
                    try:  # the zygote gets the call's socket only; its supervisor reads the request from it
                        socket.send_fds(self._ctrl, [b"c"], [theirs.fileno()])
                        break
                    except OSError as e:
                        _kill(self._proc)
                        self._proc = None
                        if attempt:
                            return RunResult(error=f"sandbox unreachable: {e}", latency_s=time.monotonic() - t0)
            theirs.close()
            deadline = time.monotonic() + limits.timeout_s + _ANSWER_GRACE_S
            try:
                mine.settimeout(_ANSWER_GRACE_S)
                mine.sendall(struct.pack("<Q", len(msg)) + msg)
            except OSError as e:
                return RunResult(error=f"the sandbox did not take the request: {e}", latency_s=time.monotonic() - t0)
            data = _read_all(mine, deadline - time.monotonic())
        finally:
            mine.close()
            if theirs.fileno() >= 0:
                theirs.close()
        latency = time.monotonic() - t0
        if data is None:
            return RunResult(error="the sandbox did not answer in time", timed_out=True, latency_s=latency)
        try:
            res = json.loads(data)
        except ValueError:
            return RunResult(error="the sandbox's supervisor died before answering", latency_s=latency)
        if "error" in res:
            return RunResult(error=res["error"], latency_s=latency)
        return RunResult(latency_s=latency, **res)


def _warn_memory(state: dict) -> None:
    """Once per process: where no memory cgroup could be made, say what bounds a call's memory instead."""
    global _warned_memory
    mem = state.get("memory") or {}
    if mem.get("cgroup") is None and state.get("fs") and not _warned_memory:
        _warned_memory = True
        logger.warning("Python sandbox: %s (why: %s)", mem.get("bound"), mem.get("why"))


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    import select

    deadline = time.monotonic() + timeout
    buf = b""
    fd = proc.stdout.fileno()
    poller = select.poll()  # not select(): a process with over 1024 files open has descriptors it cannot watch
    poller.register(fd, select.POLLIN)
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no answer in {timeout:.0f} s")
        if poller.poll(left * 1000):
            chunk = os.read(fd, 4096)
            if not chunk:
                raise ValueError(f"it exited with code {proc.wait()}")
            buf += chunk
    return buf.decode()


def _read_all(sock: socket.socket, timeout: float) -> Optional[bytes]:
    """The answer up to EOF, or None past `timeout`."""
    deadline = time.monotonic() + timeout
    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        sock.settimeout(left)
        try:
            chunk = sock.recv(1 << 16)
        except socket.timeout:
            return None
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _kill(proc: Optional[subprocess.Popen]) -> None:
    """SIGTERM the zygote (its handler stops the calls in flight), SIGKILL if it lingers."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def truncate(text: str, n: int, side: str = "middle") -> str:
    """verl's `tool_response_truncate_side`: "left" keeps the last `n` characters, "right" the first `n`,
    "middle" the first and last n // 2; a marker says where text was cut. n <= 0: no limit."""
    if n <= 0 or len(text) <= n:
        return text
    if side == "left":
        return "(truncated)..." + text[-n:]
    if side == "right":
        return text[:n] + "...(truncated)"
    if side != "middle":
        raise ValueError(f"truncate side must be left, right or middle, not {side!r}")
    half = n // 2
    return text[:half] + "...(truncated)..." + (text[-half:] if half else "")
