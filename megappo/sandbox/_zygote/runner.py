"""The runner: the forked process that becomes the call. It joins the call's memory cgroup, leaves for namespaces
of its own, drops every privilege, installs the seccomp filter and runs the code; it never returns."""
from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys

from _megappo_sandbox_kernel import (CLONE_NEWIPC, CLONE_NEWNET, CLONE_NEWUSER, CLONE_NEWUTS,  # noqa: E402
                                     KEYCTL_JOIN_SESSION_KEYRING, MS_NODEV, MS_NOEXEC, MS_NOSUID, PR_CAP_AMBIENT,
                                     PR_CAP_AMBIENT_CLEAR_ALL, PR_CAPBSET_DROP, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS,
                                     PR_SET_PDEATHSIG, check, libc, load, mount, prctl, unshare, write)

seccomp = load("seccomp")
CALL_UID = load("root").CALL_UID
_KEYCTL = {"x86_64": 250, "aarch64": 219}
_CAP_V3 = 0x20080522
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1",
       "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}


def _ipc_limits(mb: int) -> None:
    """SysV IPC bounded in the call's IPC namespace (per-namespace sysctls): shared memory to the call's memory
    bound, few queues and small ones. Best effort: a kernel may not let a user namespace's root set them."""
    pages = (mb << 20) // resource.getpagesize()
    for name, value in (("shmmax", mb << 20), ("shmall", pages), ("shmmni", 64), ("msgmnb", 65536),
                        ("msgmni", 32), ("sem", "32 1024 32 32")):
        try:
            write(f"/proc/sys/kernel/{name}", str(value))
        except OSError:
            pass


def _enter_user_namespace(outer_uid: int, outer_gid: int) -> None:
    """A nested user namespace in which the code is CALL_UID, mapped to this process's uid outside: it owns none
    of the call's other namespaces nor any mount, so none of its capabilities there reach anything."""
    unshare(CLONE_NEWUSER, "CLONE_NEWUSER")
    write("/proc/self/setgroups", "deny")
    write("/proc/self/uid_map", f"{CALL_UID} {outer_uid} 1")
    write("/proc/self/gid_map", f"{CALL_UID} {outer_gid} 1")


def _drop_capabilities(last_cap: int) -> None:
    for cap in range(last_cap + 1):
        prctl(PR_CAPBSET_DROP, cap, what=f"PR_CAPBSET_DROP {cap}")
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, what="PR_CAP_AMBIENT_CLEAR_ALL")
    header = (ctypes.c_uint32 * 2)(_CAP_V3, 0)
    data = (ctypes.c_uint32 * 6)()
    check(libc.capset(header, data), "capset")


def _set_limits(lim: dict) -> None:
    mb = 1 << 20
    for res, value in ((resource.RLIMIT_AS, lim["memory_mb"] * mb), (resource.RLIMIT_FSIZE, lim["max_file_mb"] * mb),
                       (resource.RLIMIT_NOFILE, lim["max_open_files"]), (resource.RLIMIT_CORE, 0),
                       (resource.RLIMIT_NPROC, lim["max_processes"])):
        resource.setrlimit(res, (value, value))
    # SIGKILL at the limit: the code's first process is its PID namespace's init, which ignores SIGXCPU
    resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"]))


def _prepare(ctx: dict) -> None:
    """What needs no request: namespaces of its own and /proc (before the call, off its round trip)."""
    try:
        write("/proc/self/oom_score_adj", "1000")  # the host's OOM killer takes a call first, never the trainer
    except OSError:
        pass
    if ctx["mode"] is not None:
        unshare(CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS, "CLONE_NEWNET|CLONE_NEWIPC|CLONE_NEWUTS")
        check(libc.sethostname(b"sandbox", 7), "sethostname")
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # the call's PID namespace's own


def _drop(req: dict, ctx: dict) -> None:
    """The request's limits, then every privilege, in this order (each step needs what the next drops)."""
    lim, mode = req["limits"], ctx["mode"]
    if mode is not None:
        _ipc_limits(lim["memory_mb"])
    if mode == "root":  # an unprivileged uid of the call's own: RLIMIT_NPROC counts this call's processes alone
        os.setgroups([])
        os.setresgid(ctx["uid"], ctx["uid"], ctx["uid"])
        os.setresuid(ctx["uid"], ctx["uid"], ctx["uid"])
        prctl(PR_SET_DUMPABLE, 1, what="PR_SET_DUMPABLE")  # the uid change made /proc/self root's: uid_map next
    if mode is not None:
        _enter_user_namespace(os.geteuid(), os.getegid())
        _drop_capabilities(ctx["last_cap"])
    # after the user namespace: its creator's limit would bound the parent's count too (userns mode: all calls)
    _set_limits(lim)
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL, what="PR_SET_PDEATHSIG")  # after setuid, which clears it
    prctl(PR_SET_NO_NEW_PRIVS, 1, what="PR_SET_NO_NEW_PRIVS")  # no setuid binary, no file capability
    nr = _KEYCTL.get(os.uname().machine)
    if nr is not None and libc.syscall(nr, KEYCTL_JOIN_SESSION_KEYRING, None) < 0:  # not the trainer's keyring
        check(-1, "keyctl(KEYCTL_JOIN_SESSION_KEYRING)")
    if ctx["filter"] is not None:
        seccomp.install(ctx["filter"])


def _read_request(fd: int) -> dict:
    chunks = []
    while True:
        data = os.read(fd, 1 << 16)
        if not data:
            break
        chunks.append(data)
    os.close(fd)
    if not chunks:  # the supervisor ended without a call (the sandbox stopped)
        os._exit(0)
    return json.loads(b"".join(chunks))


def run(ctx: dict, req_r: int, out_w: int, err_w: int, procs_fd: int | None) -> None:
    """In the forked child: set up, wait for the request on `req_r`, run its code, exit with its status."""
    try:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, what="PR_SET_PDEATHSIG")  # the supervisor gone: so is this
        os.setsid()
        null = os.open("/dev/null", os.O_RDONLY)
        for src, dst in ((null, 0), (out_w, 1), (err_w, 2), (req_r, 3)):
            os.dup2(src, dst)
        if procs_fd is not None:  # the call's memory cgroup, before anything of the call is allocated
            os.write(procs_fd, b"0")
        os.closerange(4, 1 << 16)  # nothing of the zygote's (its cgroup directory, sockets) stays open
        if ctx["workdir"]:
            os.chdir(ctx["workdir"])
        _prepare(ctx)
        req = _read_request(3)
        workdir = req.get("workdir") or ctx["workdir"]
        os.chdir(workdir)
        _drop(req, ctx)
    except BaseException as e:  # set-up failed: say so on the call's stderr
        try:
            os.write(2, f"sandbox: runner set-up failed: {type(e).__name__}: {e}\n".encode())
        finally:
            os._exit(126)
    _execute(req, workdir)


def _execute(req: dict, workdir: str) -> None:
    os.environ.clear()
    os.environ.update(ENV, HOME=workdir, TMPDIR=workdir)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    sys.stdout = open(1, "w", encoding="utf-8", errors="replace", closefd=False, buffering=1)
    sys.stderr = open(2, "w", encoding="utf-8", errors="replace", closefd=False, buffering=1)
    sys.stdin = open(0, "r", closefd=False)
    sys.argv = ["<code>"]
    sys.path[:] = [workdir] + [p for p in sys.path if p]
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
    except BaseException as e:
        import traceback

        traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # from the code's frame on
        if isinstance(e, MemoryError):
            print(f"MemoryError: the sandbox's memory limit is {req['limits']['memory_mb']} MB", file=sys.stderr)
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    os._exit(code)
