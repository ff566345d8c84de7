"""Run untrusted Python code under limits: the sandbox behind the built-in Python tool.

`Sandbox(limits).run(code)` runs `code` in a process of its own and returns a `RunResult` (output, exit, what
limit it hit). Thread-safe: calls from several threads run at once, each in its own process.

What holds, per call (the zygote `_zygote.py` does the work; its docstring says how). Two modes, picked by the
zygote's euid; `Sandbox.state["mode"]` says which held:

- "root" (euid 0): the namespaces are made directly, and each call runs as an unprivileged uid of its own
  (from the zygote's slice of `UID_SPACE`, at most `UID_SLICE` calls at once per sandbox), without capabilities;
- "userns" (any other user, where unprivileged user namespaces are allowed): the namespaces are made inside a user
  namespace in which the zygote is root (the user's uid mapped to 0); each call's runner enters a nested user
  namespace (it owns none of the mounts, so it can remount nothing: the read-only flags are locked).

The limits and isolation:

- CPU time per process (RLIMIT_CPU: SIGKILL at the limit), address space per process (RLIMIT_AS: Python's
  MemoryError), file size (RLIMIT_FSIZE: EFBIG), open files (RLIMIT_NOFILE), no core files;
- processes (`max_processes`, threads included): RLIMIT_NPROC counts the processes of a uid, and root (with
  CAP_SYS_RESOURCE) ignores it. Measured here: as root, 100 forks all succeed under RLIMIT_NPROC 16. So in "root"
  mode each call has a uid of its own and the limit counts exactly that call's processes; in "userns" mode the
  kernel (5.14+) counts a uid's processes per user namespace, and the runner sets the limit after entering its
  nested one, so it counts that call's processes alone, concurrent calls apart (the test checks both);
- wall time: the code leads a session of its own and is the first process of a PID namespace of its own; at
  the deadline (or at its exit, or past the output cap) the session is SIGKILLed, and with the namespace's first
  process the kernel kills every other process of the call (none can leave the namespace, setsid() or not)
  before that exit completes. When the sandbox stops, root mode also sweeps every process of a call's uid;
- no network: a network namespace with no usable interface (its loopback is down, and the code has no
  capability to raise it);
- file system: a mount namespace in which every mount is read-only (checked: the sandbox refuses to start if a
  reachable mount stayed writable); a fresh tmpfs on /tmp per call (`disk_mb`) holds the working directory
  /tmp/work (also HOME and TMPDIR) and /dev/shm, and vanishes with the call; the machine's /tmp is not visible, nor
  are `hidden_paths` (default /root, /home and /run: empty read-only directories, the interpreter's own
  directories bound back in); /proc is the call's own (its PID namespace's processes only); The rest of the file system stays readable, as the call's user may read it;
- output: stdout and stderr are read as they come; the head and tail (`keep_bytes` each) are kept, the rest is
  counted and dropped, and past `max_output_bytes` in total the code is stopped (`output_limited`).

Not limited: the memory of a call in all (RLIMIT_AS is per process, so `max_processes` x `memory_mb` at most), and
what the code reads (a cgroup per call would bound the first; see the README).

Probed on the project's CI machine (a Firecracker VM, Linux 6.18, cgroup v1): we run as root with every
capability; `unshare(CLONE_NEWNET)`, `CLONE_NEWNS`, `CLONE_NEWPID` and user namespaces (also for an unprivileged
user: `setpriv --reuid=65534 unshare -U -r -n -m` works) all work; a network namespace costs ~1.5 ms and a mount
namespace with a tmpfs ~1 ms. The cgroup v1 pids controller is mounted, but only its root cgroup exists
(`pids.max` absent there); the per-call uid makes RLIMIT_NPROC hold instead, with no cgroup to create and remove
per call.

Where it cannot isolate (a container without CAP_SYS_ADMIN, a non-root user without user namespaces, not
Linux), starting the sandbox raises `SandboxUnavailable` saying why, unless the config accepts it:
`allow_network_unsandboxed` (the code may use the network) and `allow_filesystem_unsandboxed` (the code runs as
this process's user in a temporary directory under the machine's /tmp, removed afterwards; it can write wherever
that user can, RLIMIT_NPROC counts all of that user's processes (as root: none), and a setsid()-escaped process
survives the call).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

_ZYGOTE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_zygote.py")
_START_TIMEOUT_S = 30.0
_ANSWER_GRACE_S = 5.0
_ZYGOTE_ENV = ("PATH", "LANG", "LC_ALL", "TZ", "LD_LIBRARY_PATH")  # what an interpreter may need to start
# root's home, the users' homes, and /run (the user's D-Bus and systemd sockets: connect() to a socket file is not
# stopped by a read-only mount, and a user's systemd can start processes outside the sandbox)
DEFAULT_HIDDEN_PATHS = ("/root", "/home", "/run")
MAX_REQUEST_BYTES = 100 * 1024  # code + limits, sent as one SOCK_SEQPACKET datagram (under the ~200 KB buffer)
# root mode: the calls' uids. Each zygote takes a slice of UID_SLICE uids at UID_SPACE + (its pid mod 2^22) x
# UID_SLICE (below 2^31: some tools read uids as signed), so no two live zygotes share a uid.
UID_SPACE, UID_SLICE = 1_000_000_000, 256  # past the call's timeout: the supervisor's kill, sweep and answer


class SandboxUnavailable(RuntimeError):
    """The machine does not allow the isolation asked for."""


@dataclass
class Limits:
    timeout_s: float = 10.0  # wall time of one call
    cpu_s: int = 10  # CPU seconds (all the call's threads; each process has its own count)
    memory_mb: int = 1024  # address space of each process
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
    stdout_bytes: int = 0  # all it wrote, kept or not
    stderr_bytes: int = 0
    cpu_s: float = 0.0
    run_s: float = 0.0  # from the runner's fork to its end
    setup_s: float = 0.0  # supervisor's share before the code runs (mount namespace, tmpfs, pipes)
    latency_s: float = 0.0  # the caller's round trip
    error: Optional[str] = None  # the sandbox itself failed (not the code)


class Sandbox:
    """A zygote process isolated once; `run` asks it for one call. `close()` (or the trainer's death) ends it and
    every call in flight."""

    def __init__(self, limits: Optional[Limits] = None, allow_network_unsandboxed: bool = False,
                 allow_filesystem_unsandboxed: bool = False, uid_base: int = UID_SPACE, uid_count: int = UID_SLICE,
                 python: Optional[str] = None, hidden_paths: Sequence[str] = DEFAULT_HIDDEN_PATHS):
        self.limits = limits or Limits()
        self.allow_network_unsandboxed = allow_network_unsandboxed
        self.allow_filesystem_unsandboxed = allow_filesystem_unsandboxed
        self.uid_base, self.uid_count = uid_base, uid_count
        self.hidden_paths = [str(p) for p in hidden_paths]
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
        cmd = [self.python, "-I", _ZYGOTE, str(theirs.fileno()), "1", "1", str(self.uid_base), str(self.uid_count),
               ":".join(self.hidden_paths)]
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
        why = "; ".join(state.get("why") or [])
        problems = []
        if not state["net"] and not self.allow_network_unsandboxed:
            problems.append("no network namespace, so the code could reach the network (set "
                            "allow_network_unsandboxed: true to accept that)")
        if not state["fs"] and not self.allow_filesystem_unsandboxed:
            problems.append("no read-only mount namespace, so the code could write wherever this process's user "
                            "can (set allow_filesystem_unsandboxed: true to accept that)")
        if problems:
            ours.close()
            _kill(proc)
            raise SandboxUnavailable(f"refusing to start the Python sandbox: {'; '.join(problems)}. "
                                     f"Why: {why or 'unknown'}")
        self._proc, self._ctrl, self.state = proc, ours, state

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
        if len(msg) > MAX_REQUEST_BYTES:  # one datagram to the zygote: a socket buffer's worth at most
            return RunResult(error=f"the code is {len(code.encode())} bytes; the limit is {MAX_REQUEST_BYTES - 1024}")
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            for attempt in range(2):  # a zygote that died (killed from outside) is started again once
                with self._lock:
                    self._start_locked()
                    try:
                        socket.send_fds(self._ctrl, [msg], [theirs.fileno()])
                        break
                    except OSError as e:
                        _kill(self._proc)
                        self._proc = None
                        if attempt:
                            return RunResult(error=f"sandbox unreachable: {e}", latency_s=time.monotonic() - t0)
            theirs.close()
            data = _read_all(mine, limits.timeout_s + _ANSWER_GRACE_S)
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


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    import select

    deadline = time.monotonic() + timeout
    buf = b""
    fd = proc.stdout.fileno()
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no answer in {timeout:.0f} s")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
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
