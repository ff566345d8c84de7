"""The sandbox's zygote: a small Python process, isolated once, that forks one supervisor per call.

    python -I _zygote.py CONTROL_FD ISOLATE_NET ISOLATE_FS UID_SPACE UID_COUNT HIDDEN_PATHS

Standard library only, started by `sandbox.Sandbox` with `python -I` (no PYTHONPATH, no cwd on sys.path). Why a
zygote: a fresh interpreter per call costs ~25 ms of start-up alone, and forking the trainer (GBs, threads) is
neither cheap nor safe. This process pays the start-up and the isolation once; a call then costs two forks.

At start it leaves the machine's network (a network namespace of its own, its loopback down: no interface at all)
and its mounts (a mount namespace where every mount is remounted read-only and private), then prints one JSON line
on stdout saying what held, and serves requests on CONTROL_FD (a SOCK_SEQPACKET socket): one JSON message per
call, carrying the write end of a per-call result socket (SCM_RIGHTS).

Per call, a supervisor (forked, root in the sandbox's namespaces):
- enters a mount namespace of its own with a fresh tmpfs on /tmp (size-limited, gone with the call: the working
  directory /tmp/work, also HOME and TMPDIR) and /dev/shm bound into it, and a PID namespace for its next child,
- forks the runner (that namespace's first process), which leads a new session, mounts the namespace's own
  /proc, sets the rlimits and drops its capabilities, so nothing read-only can be made writable again (root
  mode: an unprivileged uid of its own for this call, so RLIMIT_NPROC counts only this call's processes, which
  it cannot do for root; userns mode: a nested user namespace), and exec()s the code in the forked interpreter,
- reads stdout and stderr as they come, keeping the head and tail only (the rest is counted, never stored), until
  EOF and exit, the wall deadline, or the output cap,
- then kills the session with SIGKILL, and with its first process the call's PID namespace goes: the kernel
  kills every process of the call (a setsid()-escaped grandchild too) before the runner's exit completes; and
  answers with one JSON message. When the zygote stops (its trainer gone, or close()), it kills its supervisors
  (their runners die with them: PR_SET_PDEATHSIG) and, in root mode, sweeps every process left with a call's uid
  (kill(-1) from that uid).
"""
from __future__ import annotations

import ctypes
import json
import os
import resource
import select
import signal
import socket
import sys
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
CLONE_NEWUSER, CLONE_NEWPID = 0x10000000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
# kept through a bind remount: dropping them is refused (always for a mount locked by a user namespace)
_MOUNT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": 1024, "nodiratime": 2048,
                "relatime": 1 << 21, "strictatime": 1 << 24}

libc = ctypes.CDLL(None, use_errno=True)
_live: dict[int, int] = {}  # supervisor pid -> the uid of its call
_wake: list[int] = []  # the zygote's SIGCHLD wake-up pipe (read end, write end)
_uid_next = 0


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src, target, fstype, flags, data=None) -> None:
    enc = lambda s: s.encode() if isinstance(s, str) else s
    _check(libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _make_readonly() -> list[str]:
    """Every mount of this (new) namespace private and read-only; returns the mount points still writable. A bind
    remount keeps a mount's per-mount flags (nosuid/nodev/noexec and atime), read from mountinfo: dropping them
    is refused."""
    _mount("none", "/", None, MS_REC | MS_PRIVATE)
    for target, opts in sorted(_mounts(), key=lambda m: m[0].count("/")):
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for opt in opts.split(","):
            flags |= _MOUNT_FLAGS.get(opt, 0)
        try:
            _mount(None, target, None, flags)
        except OSError:
            pass  # a mount hidden under another one cannot be reached (nor written); the check below says
    top = dict(_mounts())  # a path's last mount is the one reached there; those under it are hidden
    return [target for target, opts in top.items() if "rw" in opts.split(",")]


def _mounts() -> list[tuple[str, str]]:
    """(mount point, per-mount options) of this mount namespace."""
    with open("/proc/self/mountinfo") as f:
        rows = [line.split() for line in f]
    # mountinfo escapes spaces and the like as \040
    return [(r[4].encode().decode("unicode_escape"), r[5]) for r in rows]


def _interpreter_paths() -> set[str]:
    """The directories (and files) the interpreter needs: its prefixes, executable and sys.path."""
    return {os.path.realpath(p) for p in [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                                          os.path.dirname(os.path.realpath(sys.executable)), *sys.path] if p}


def _hide(hidden: list[str]) -> None:
    """An empty read-only tmpfs over each of `hidden` (root's home: the interpreter may live there, and /root is
    0700, unreadable to the call's uid), with the interpreter's own directories bound back in at their paths."""
    needed = _interpreter_paths()
    for top in hidden:
        top = os.path.realpath(top)
        if os.path.isdir(top) and top != "/":
            _cover(top, "size=64k,mode=0755", needed)


def _cover(top: str, options: str, needed: set[str]) -> None:
    """A fresh tmpfs (mount `options`) over the directory `top`, with the paths of `needed` under it bound back in
    at their paths (a venv under /tmp stays importable when the call gets a /tmp of its own)."""
    inside = sorted(p for p in needed if (p + "/").startswith(top + "/") and os.path.exists(p))
    keep = [p for k, p in enumerate(inside) if not any((p + "/").startswith(q + "/") for q in inside[:k])]
    handles = [(p, os.open(p, os.O_PATH)) for p in keep]  # reachable still once the tmpfs hides them
    _mount("tmpfs", top, "tmpfs", MS_NOSUID | MS_NODEV, options)
    for p, fd in handles:
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.makedirs(p, 0o755, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(p), 0o755, exist_ok=True)
            open(p, "w").close()
        _mount(f"/proc/self/fd/{fd}", p, None, MS_BIND | MS_REC)
        os.close(fd)


def _isolate(net: bool, fs: bool, hidden: list[str]) -> dict:
    """Leave the network and the writable mounts; say what held (and why not).

    As root ("root" mode) the namespaces are made directly and each call runs as an unprivileged uid of its own.
    Otherwise ("userns" mode) they are made inside a user namespace in which this process is root (the user's own
    uid mapped to 0): each call's runner enters a nested user namespace, which leaves it no capability over these
    mounts. Either way each call has a PID namespace of its own, which the kernel empties when the runner ends."""
    state = {"net": False, "fs": False, "mode": None, "root": os.geteuid() == 0, "why": []}
    uid, gid = os.geteuid(), os.getegid()
    flags = (CLONE_NEWNET if net else 0) | (CLONE_NEWNS if fs else 0)
    if flags and not state["root"]:
        flags |= CLONE_NEWUSER
    if flags and libc.unshare(flags) != 0:
        err = ctypes.get_errno()
        what = "unshare(CLONE_NEWNET|CLONE_NEWNS" + ("" if state["root"] else "|CLONE_NEWUSER") + ")"
        hint = ("needs CAP_SYS_ADMIN: a container started without it, or seccomp, refuses it" if state["root"] else
                "needs unprivileged user namespaces (kernel.unprivileged_userns_clone=1, user.max_user_namespaces>0,"
                " no AppArmor restriction), or root")
        state["why"].append(f"{what} failed: {os.strerror(err)} (euid {uid}; {hint})")
        return state
    if flags & CLONE_NEWUSER:
        try:
            for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        except OSError as e:
            state["why"].append(f"user namespace map failed: {e}")
            return state
    state["net"] = net
    if fs:
        try:
            _hide(hidden)
            writable = _make_readonly()
            if writable:
                state["why"].append(f"mounts still writable after the read-only remount: {writable[:5]}")
            else:
                state["fs"] = True
                state["mode"] = "root" if state["root"] else "userns"
        except OSError as e:
            state["why"].append(f"read-only remount of the file system failed: {e}")
    return state


def _set_limits(lim: dict) -> None:
    mb = 1 << 20
    for res, value in ((resource.RLIMIT_AS, lim["memory_mb"] * mb), (resource.RLIMIT_FSIZE, lim["max_file_mb"] * mb),
                       (resource.RLIMIT_NOFILE, lim["max_open_files"]), (resource.RLIMIT_CORE, 0),
                       (resource.RLIMIT_NPROC, lim["max_processes"])):
        resource.setrlimit(res, (value, value))
    # SIGKILL at the limit: the code's first process is its PID namespace's init, which ignores SIGXCPU
    resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"]))


def _run_code(req: dict, uid: int, mode: str | None, out_w: int, err_w: int, workdir: str) -> None:
    """The runner, in the forked child: never returns."""
    try:
        os.setsid()
        null = os.open("/dev/null", os.O_RDONLY)
        for src, dst in ((null, 0), (out_w, 1), (err_w, 2)):
            os.dup2(src, dst)
        os.closerange(3, 1 << 16)
        os.chdir(workdir)
        if mode is not None:  # still privileged here (root, or root of the zygote's user namespace)
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        if mode == "userns":  # a nested user namespace owns none of the mounts: no remount. Before the limits:
            # RLIMIT_NPROC then counts this namespace's processes alone (5.14+), not the user's (see sandbox.py)
            _check(libc.unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
        _set_limits(req["limits"])
        if mode == "root":  # drops every capability: nothing can be remounted, no uid changed back
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after setuid, which clears it
        os.environ.clear()
        os.environ.update({"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir,
                           "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1",
                           "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"})
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        sys.stdout = open(1, "w", encoding="utf-8", errors="replace", closefd=False, buffering=1)
        sys.stderr = open(2, "w", encoding="utf-8", errors="replace", closefd=False, buffering=1)
        sys.stdin = open(0, "r", closefd=False)
        sys.argv = ["<code>"]
        sys.path[:] = [workdir] + [p for p in sys.path if p]
        for name in list(sys.modules):  # the zygote's __main__ is not the code's
            if name == "__main__":
                del sys.modules[name]
        code = 0
        try:
            import types

            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(req["code"], "<code>", "exec"), main.__dict__)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
        except MemoryError as e:
            import traceback

            traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # from the code's frame on
            print(f"MemoryError: the sandbox's memory limit is {req['limits']['memory_mb']} MB", file=sys.stderr)
            code = 1
        except BaseException as e:
            import traceback

            traceback.print_exception(type(e), e, e.__traceback__.tb_next)
            code = 1
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            pass
        os._exit(code)
    except BaseException as e:  # set-up failed: say so on the call's stderr
        try:
            os.write(2, f"sandbox: runner set-up failed: {type(e).__name__}: {e}\n".encode())
        finally:
            os._exit(126)


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


def _sweep(uid: int) -> None:
    """SIGKILL every process running as `uid` (escaped from the session or not) and reap them, until none is left.

    A helper that is `uid` itself sends kill(-1), which reaches exactly the processes it may signal (itself
    excepted; no /proc scan, which a non-dumpable process would dodge). Whether any is left, zombies included, the
    kernel says: the helper, with RLIMIT_NPROC 2 and no capability, can fork only if it is the uid's only process.
    kill(-1) itself cannot tell: it succeeds even where it reached nobody."""
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


def _supervise(req: dict, uid: int, state: dict, result_fd: int) -> dict:
    lim = req["limits"]
    t0 = time.monotonic()
    if state["fs"]:
        # The runner is the first process of a PID namespace: when it ends (exit or kill) the kernel kills every
        # other process of the call, which cannot leave the namespace (setsid() or not), and the runner's exit
        # waits for them; its own /proc shows them alone, not the machine's processes and their command lines.
        _check(libc.unshare(CLONE_NEWNS | CLONE_NEWPID), "unshare(CLONE_NEWNS|CLONE_NEWPID)")
        _cover("/tmp", f"size={lim['disk_mb']}m,mode=0755", _interpreter_paths())
        workdir = "/tmp/work"
        for d in (workdir, "/tmp/.shm"):
            os.mkdir(d, 0o700)
            if uid >= 0:
                os.chown(d, uid, uid)
        if os.path.isdir("/dev/shm"):
            _mount("/tmp/.shm", "/dev/shm", None, MS_BIND)
    else:
        import tempfile

        workdir = tempfile.mkdtemp(prefix="megappo-sandbox-")
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans of the code come here, to be reaped
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    setup_s = time.monotonic() - t0
    runner = os.fork()
    if runner == 0:
        os.close(out_r)
        os.close(err_r)
        os.close(result_fd)
        _run_code(req, uid, state["mode"], out_w, err_w, workdir)
    t_run = time.monotonic()
    os.close(out_w)
    os.close(err_w)
    keep = lim["keep_bytes"]
    caps = {out_r: _Capture(keep), err_r: _Capture(keep)}
    deadline = t_run + lim["timeout_s"]
    timed_out = output_limited = False
    status = None
    open_fds = [out_r, err_r]
    # The runner's exit ends the call even where a child of it still holds the pipes open: a pidfd (Linux 5.3)
    # turns readable at the exit, so nothing polls; without one, a 10 ms poll of waitpid.
    try:
        pidfd = os.pidfd_open(runner)
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
            pid, st = os.waitpid(runner, os.WNOHANG)
            if pid:
                status = st
                _drain(open_fds, caps)
                break
    if pidfd is not None:
        os.close(pidfd)
    run_s = time.monotonic() - t_run
    try:  # the session at once; what escaped it goes in the sweep, after the answer
        os.killpg(runner, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if status is None:
        _, status = os.waitpid(runner, 0)
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            "timed_out": timed_out, "output_limited": output_limited,
            "stdout": caps[out_r].text(), "stderr": caps[err_r].text(),
            "stdout_bytes": caps[out_r].total, "stderr_bytes": caps[err_r].total,
            "cpu_s": cpu.ru_utime + cpu.ru_stime, "run_s": run_s, "setup_s": setup_s}, workdir


def _clean_up(uid: int, state: dict, workdir: str | None) -> None:
    """Unsandboxed mode: the working directory removed. (Isolated: the call's processes went with its PID
    namespace before the answer, and its tmpfs goes with its mount namespace's last process, this one.) Runs after
    the answer, off the caller's round trip."""
    if workdir and not state["fs"]:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    _reap_all()


def _supervisor_main(req: dict, uid: int, state: dict, result_fd: int) -> None:
    os.setsid()  # away from the zygote's group: the trainer's Ctrl-C is the zygote's business
    signal.set_wakeup_fd(-1)
    for fd in _wake:
        os.close(fd)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    workdir = None
    try:
        res, workdir = _supervise(req, uid, state, result_fd)
    except BaseException as e:
        res = {"error": f"sandbox supervisor: {type(e).__name__}: {e}"}
    try:
        os.write(result_fd, json.dumps(res).encode())
        os.close(result_fd)
    except OSError:
        pass  # the caller gave up on this call
    _clean_up(uid, state, workdir)
    os._exit(0)


def _free_uid(uid_base: int, uid_count: int) -> int:
    """A uid of this zygote's slice that no call in flight has: RLIMIT_NPROC and the sweep count on it. With every
    one taken, wait for a call to end."""
    global _uid_next
    while True:
        in_use = set(_live.values())
        for _ in range(uid_count):
            uid = uid_base + _uid_next % uid_count
            _uid_next += 1
            if uid not in in_use:
                return uid
        _reap_supervisors(block=True, one=True)


def _reap_supervisors(block: bool = False, one: bool = False) -> None:
    while _live:
        try:
            pid, _ = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            _live.clear()
            return
        if pid == 0:
            return
        _live.pop(pid, None)
        if one:
            return


def _stop(*_args) -> None:
    """Stop every call in flight (its supervisor's group and its uid's processes) and leave."""
    for pid, uid in list(_live.items()):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if uid >= 0:
            _sweep(uid)
    _reap_supervisors(block=True)
    os._exit(0)


def main() -> None:
    ctrl_fd, net, fs, uid_space, uid_count = (int(a) for a in sys.argv[1:6])
    # This zygote's uids: a slice of its own, by its pid (no two live zygotes share one: other sandboxes, Ray
    # actors, other runs on the machine), since a call's uid must be its alone (the sweep kills all of its uid).
    uid_base = uid_space + (os.getpid() % (1 << 22)) * uid_count
    hidden = [p for p in sys.argv[6].split(":") if p] if len(sys.argv) > 6 else []
    if sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # megappo's own directory is none of the code's business
    parent = os.getppid()
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer decides when the sandbox ends
    # The parent-death signal fires when the parent's *thread* that started us ends (a pool thread), not only the
    # process, so it only wakes the loop, which checks getppid(); the control socket's EOF says it too.
    signal.signal(signal.SIGHUP, lambda *_: None)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGHUP, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(0)
    state = _isolate(bool(net), bool(fs), hidden)
    print(json.dumps(state), flush=True)
    # Each fork copies what it touches (copy-on-write): the collector walking every object of the zygote in each
    # child would touch it all. Frozen objects are never walked; what the runner needs is imported once here.
    import gc
    import traceback  # (a failing call's traceback)
    import types

    del traceback, types  # (imported for the runner: they stay in sys.modules)
    gc.freeze()
    ctrl = socket.socket(fileno=ctrl_fd)
    # a supervisor's exit wakes the loop (SIGCHLD on a wake-up pipe): reaped at once, not at the next poll
    wake_r, wake_w = _wake[:] = os.pipe()
    for fd in (wake_r, wake_w):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        _reap_supervisors()
        if os.getppid() != parent:  # the trainer died (SIGKILL too): end every call
            _stop()
        ready, _, _ = select.select([ctrl, wake_r], [], [], 0.5)
        if wake_r in ready:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
        if ctrl not in ready:
            continue
        try:
            msg, fds, _, _ = socket.recv_fds(ctrl, 1 << 24, 1)
        except OSError:
            msg, fds = b"", []
        if not msg:  # the Sandbox closed (or its process died)
            _stop()
        req = json.loads(msg)
        uid = _free_uid(uid_base, uid_count) if state["mode"] == "root" else -1
        pid = os.fork()
        if pid == 0:
            ctrl.close()
            _supervisor_main(req, uid, state, fds[0])
        _live[pid] = uid
        for fd in fds:
            os.close(fd)


if __name__ == "__main__":
    main()
