"""The supervisor of one call: forked by the zygote, it reads the request, sets the call up, forks the runner,
captures its output under the limits, answers and cleans up."""
from __future__ import annotations

import json
import os
import resource
import select
import signal
import socket
import struct
import time

from _megappo_sandbox_kernel import (CLONE_NEWNS, CLONE_NEWPID, MS_NODEV, MS_NOSUID, MS_REMOUNT,  # noqa: E402
                                     PR_SET_CHILD_SUBREAPER, load, mount, prctl, unshare)

root, runner = load("root"), load("runner")
MAX_REQUEST_BYTES = 1 << 20
_REQUEST_TIMEOUT_S = 10.0


class _Capture:
    """One stream's head and tail, `keep` bytes each, and its total length."""

    def __init__(self, keep: int):
        self.keep, self.head, self.tail, self.total = keep, bytearray(), bytearray(), 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.keep - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            del self.tail[:-self.keep]

    def text(self) -> str:
        skipped = self.total - len(self.head) - len(self.tail)
        mid = f"\n...[{skipped} bytes not kept]...\n".encode() if skipped > 0 else b""
        return (bytes(self.head) + mid + bytes(self.tail)).decode("utf-8", errors="replace")


def read_request(sock: socket.socket) -> dict:
    """The request from the caller: an 8-byte length, then that much JSON (code and limits)."""
    sock.settimeout(_REQUEST_TIMEOUT_S)

    def exactly(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise EOFError("the caller closed before sending the whole request")
            buf += chunk
        return bytes(buf)

    (n,) = struct.unpack("<Q", exactly(8))
    if n > MAX_REQUEST_BYTES:
        raise ValueError(f"request of {n} bytes")
    return json.loads(exactly(n))


def sweep(uid: int) -> None:
    """SIGKILL every process running as `uid` (escaped from the session or not) and reap them, until none is left.

    A helper that is `uid` itself sends kill(-1), which reaches exactly the processes it may signal (itself
    excepted; no /proc scan, which a non-dumpable process would dodge). Whether any is left, zombies included, the
    kernel says: the helper, with RLIMIT_NPROC 2 and no capability, can fork only if it is the uid's only process."""
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        pid = os.fork()
        if pid == 0:
            try:
                os.setresuid(uid, uid, uid)
                os.kill(-1, signal.SIGKILL)
                resource.setrlimit(resource.RLIMIT_NPROC, (2, 2))
                try:
                    child = os.fork()
                except BlockingIOError:
                    os._exit(0)  # others are left
                if child == 0:
                    os._exit(0)
                os.waitpid(child, 0)
                os._exit(1)  # none left
            except BaseException:
                os._exit(2)
        _, status = os.waitpid(pid, 0)
        _reap_all()
        if os.WEXITSTATUS(status) != 0:
            return
        time.sleep(0.001)


def _reap_all() -> None:
    """Reap the exited processes that came to this subreaper."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _drain(fds: list[int], caps: dict) -> None:
    """What the exited code left in the pipes (its own output up to its exit)."""
    for fd in fds:
        os.set_blocking(fd, False)
        try:
            while True:
                data = os.read(fd, 1 << 16)
                if not data:
                    break
                caps[fd].add(data)
        except BlockingIOError:
            pass


def _watch(runner_pid: int, out_r: int, err_r: int, lim: dict) -> dict:
    """Read the output until the runner's exit, the wall deadline or the output cap; then kill the session."""
    caps = {out_r: _Capture(lim["keep_bytes"]), err_r: _Capture(lim["keep_bytes"])}
    t_run = time.monotonic()
    deadline = t_run + lim["timeout_s"]
    timed_out = output_limited = False
    status = None
    open_fds = [out_r, err_r]
    # The runner's exit ends the call even where a child of it still holds the pipes open: its pidfd turns
    # readable at the exit (Linux 5.3); without one, a 10 ms poll of waitpid.
    try:
        pidfd = os.pidfd_open(runner_pid)
    except (AttributeError, OSError):
        pidfd = None
    while True:
        now = time.monotonic()
        if now >= deadline:
            timed_out = True
            break
        wait = deadline - now if pidfd is not None else min(deadline - now, 0.01)
        ready, _, _ = select.select(open_fds + ([pidfd] if pidfd is not None else []), [], [], wait)
        for fd in ready:
            if fd == pidfd:
                continue
            data = os.read(fd, 1 << 16)
            if data:
                caps[fd].add(data)
            else:
                open_fds.remove(fd)
        if sum(c.total for c in caps.values()) > lim["max_output_bytes"]:
            output_limited = True
            break
        if pidfd is None or pidfd in ready:
            pid, st = os.waitpid(runner_pid, os.WNOHANG)
            if pid:
                status = st
                _drain(open_fds, caps)
                break
    if pidfd is not None:
        os.close(pidfd)
    run_s = time.monotonic() - t_run
    try:  # the session at once; the PID namespace takes the rest with its first process
        os.killpg(runner_pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if status is None:
        _, status = os.waitpid(runner_pid, 0)
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            "timed_out": timed_out, "output_limited": output_limited,
            "stdout": caps[out_r].text(), "stderr": caps[err_r].text(),
            "stdout_bytes": caps[out_r].total, "stderr_bytes": caps[err_r].total,
            "cpu_s": cpu.ru_utime + cpu.ru_stime, "run_s": run_s}


def _set_up(ctx: dict, slots) -> dict:
    """Everything of a call that needs no request, done before one comes: its mount and PID namespaces, its tmpfs
    (the sandbox's disk_mb; resized to the request's), its cgroup, and the runner, forked and waiting for the
    request with its other namespaces made."""
    workdir = None  # unsandboxed: a directory under the zygote's calls_dir, made when the call comes
    if ctx["fs"]:
        # The runner is the first process of a PID namespace: when it ends (exit or kill) the kernel kills every
        # other process of the call, and the runner's exit waits for them.
        unshare(CLONE_NEWNS | CLONE_NEWPID, "CLONE_NEWNS|CLONE_NEWPID")
        workdir = root.cover_tmp(ctx["disk_mb"], ctx["uid"], ctx["under_tmp"])
    procs_fd = slots.procs_fd(ctx["slot"]) if ctx["cgroup"] else None
    prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of the code come here, to be reaped
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    req_r, req_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        for fd in (out_r, err_r, req_w):
            os.close(fd)
        runner.run(dict(ctx, workdir=workdir), req_r, out_w, err_w, procs_fd)
    for fd in (out_w, err_w, req_r) + ((procs_fd,) if procs_fd is not None else ()):
        os.close(fd)
    return {"pid": pid, "out_r": out_r, "err_r": err_r, "req_w": req_w, "workdir": workdir}


def _start(req: dict, call: dict, ctx: dict, slots) -> dict:
    """The request's share of the set-up, then the request to the waiting runner; returns the answer."""
    lim = req["limits"]
    t0 = time.monotonic()
    if ctx["fs"] and lim["disk_mb"] != ctx["disk_mb"]:
        mount("tmpfs", "/tmp", None, MS_REMOUNT | MS_NOSUID | MS_NODEV, f"size={lim['disk_mb']}m")
    ooms = slots.limit(ctx["slot"], lim["memory_mb"] << 20) if ctx["cgroup"] else 0
    if call["workdir"] is None:
        import tempfile

        call["workdir"] = req["workdir"] = tempfile.mkdtemp(prefix="call-", dir=ctx["calls_dir"])
    data = json.dumps(req).encode()
    _write_all(call["req_w"], data)
    os.close(call["req_w"])
    setup_s = time.monotonic() - t0
    res = _watch(call["pid"], call["out_r"], call["err_r"], lim)
    res["setup_s"] = setup_s
    res["memory_limited"] = bool(ctx["cgroup"]) and slots.oom_kills(ctx["slot"]) > ooms
    return res


def _write_all(fd: int, data: bytes) -> None:
    """All of `data` to the runner; a runner whose set-up failed has left: its stderr says why."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view):]
    except BrokenPipeError:
        pass


def main(chan_fd: int, ctx: dict, slots, wake: list[int]) -> None:
    """The supervisor process: sets a call up, waits on `chan_fd` for the call's socket, serves it; never
    returns."""
    os.setsid()  # away from the zygote's group: the trainer's Ctrl-C is the zygote's business
    signal.set_wakeup_fd(-1)
    for fd in wake:
        os.close(fd)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    call, failed = None, None
    try:
        call = _set_up(ctx, slots)
    except BaseException as e:
        failed = f"sandbox supervisor: {type(e).__name__}: {e}"
    chan = socket.socket(fileno=chan_fd)
    try:
        _, fds, _, _ = socket.recv_fds(chan, 16, 1)
    except OSError:
        fds = []
    chan.close()
    if not fds:  # the zygote stopped before a call came
        os._exit(0)
    sock = socket.socket(fileno=fds[0])
    try:
        req = read_request(sock)
        res = _start(req, call, ctx, slots) if failed is None else {"error": failed}
    except BaseException as e:
        res = {"error": f"sandbox supervisor: {type(e).__name__}: {e}"}
    if call is not None and not ctx["fs"] and call["workdir"]:
        import shutil

        # Before the answer: the caller may close the sandbox at once, and the zygote kills supervisors in flight.
        shutil.rmtree(call["workdir"], ignore_errors=True)
    try:
        sock.settimeout(None)
        sock.sendall(json.dumps(res).encode())
        sock.close()
    except OSError:
        pass  # the caller gave up on this call
    _reap_all()
    os._exit(0)
