"""The sandbox's zygote: a small Python process, isolated once, that forks one supervisor per call.

    python -I zygote.py CONTROL_FD CONFIG_JSON

Standard library only, started by `sandbox.Sandbox` with `python -I`. Why a zygote: a fresh interpreter per call
costs ~25 ms of start-up alone, and forking the trainer (GBs, threads) is neither cheap nor safe. This process pays
the start-up and the file system's set-up once; a call then costs two forks and a few namespaces.

At start it opens its memory cgroup (`cgroup.py`), leaves the machine's mounts and network (a mount and a network
namespace; not root: inside a user namespace of its own) and pivots into the allow-list root (`root.py`), then
prints one JSON line saying what held and serves CONTROL_FD (SOCK_SEQPACKET): each message carries one per-call
socket (SCM_RIGHTS) and nothing else. The zygote never sees a call's code or output, so no call can find an
earlier one in the memory it inherits.

Per call, a supervisor (`supervise.py`), forked before the call comes (the spare; the zygote forks the next one
as it hands a call over): enters a mount and a PID namespace of its own with a fresh tmpfs on /tmp, forks the
runner (`runner.py`: the PID namespace's first process, in the call's memory cgroup, with its own IPC, network and
UTS namespaces and /proc), and waits. Handed the call's socket, it reads the request (code and limits), sets the
tmpfs size and the cgroup's limit, passes the request to the runner (which drops every privilege and runs the
code), reads stdout and stderr as they come (head and tail kept), and at the code's exit, the wall deadline or the
output cap kills the session; with its first process the PID namespace goes (every process of the call, setsid()
or not). It answers on the call's socket, then exits: its mount namespace and the call's tmpfs go with it, and the
call's IPC namespace with its SysV objects went with the runner. When the zygote stops (its trainer gone, or
close()), it kills its supervisors (their runners die with them: PR_SET_PDEATHSIG), in root mode sweeps every
process left with a call's uid, and removes its cgroups.
"""
from __future__ import annotations

import importlib.util
import json
import os
import select
import signal
import socket
import sys
import time


def _load_kernel():
    """kernel.py by path (`python -I`: this directory is not on sys.path); it loads the others."""
    name = "_megappo_sandbox_kernel"
    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(__file__), "kernel.py"))
    mod = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


kernel = _load_kernel()
seccomp, cgroup, root, supervise = (kernel.load(m) for m in ("seccomp", "cgroup", "root", "supervise"))

_live: dict[int, tuple[int, int]] = {}  # supervisor pid -> (its call's uid, its cgroup slot)
_wake: list[int] = []  # the zygote's SIGCHLD wake-up pipe (read end, write end)
_next = 0
_slots = None
_MODE = None  # "root", "userns" or None: what held at start
_calls_dir = None  # unsandboxed (no private /tmp): every call's directory is made under it, removed at the end


def _isolate(cfg: dict) -> dict:
    """Leave the network and the machine's file system; say what held (and why not)."""
    state = {"net": False, "fs": False, "mode": None, "root": os.geteuid() == 0, "why": [], "binds": []}
    uid, gid = os.geteuid(), os.getegid()
    flags = (kernel.CLONE_NEWNET if cfg["net"] else 0) | (kernel.CLONE_NEWNS if cfg["fs"] else 0)
    if flags and not state["root"]:
        flags |= kernel.CLONE_NEWUSER
    if flags and kernel.libc.unshare(flags) != 0:
        err = kernel.ctypes.get_errno()
        what = "unshare(CLONE_NEWNET|CLONE_NEWNS" + ("" if state["root"] else "|CLONE_NEWUSER") + ")"
        hint = ("needs CAP_SYS_ADMIN: a container started without it, or seccomp, refuses it" if state["root"] else
                "needs unprivileged user namespaces (kernel.unprivileged_userns_clone=1, user.max_user_namespaces>0,"
                " no AppArmor restriction), or root")
        state["why"].append(f"{what} failed: {os.strerror(err)} (euid {uid}; {hint})")
        return state
    if flags & kernel.CLONE_NEWUSER:
        try:
            for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
                kernel.write(f"/proc/self/{name}", text)
        except OSError as e:
            state["why"].append(f"user namespace map failed: {e}")
            return state
    state["net"] = bool(cfg["net"])
    if cfg["fs"]:
        try:
            state["binds"] = root.build(cfg["readable"])
            writable = root.writable_mounts()
            if writable:
                state["why"].append(f"mounts still writable in the new root: {writable[:5]}")
            else:
                state["fs"] = True
                state["mode"] = "root" if state["root"] else "userns"
        except OSError as e:
            state["why"].append(f"building the sandbox's root failed: {e}")
    return state


def _probe_seccomp() -> str:
    """'' where the filter installs (in a throwaway child), else why not."""
    if not seccomp.supported():
        return f"no seccomp filter for {os.uname().machine} (known: {sorted(seccomp.SYSCALLS)})"
    pid = os.fork()
    if pid == 0:
        try:
            seccomp.install(seccomp.compile_filter(block_memfd=True))
            os._exit(0 if kernel.libc.unshare(kernel.CLONE_NEWNS) != 0 else 3)  # refused: it holds
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    return "" if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 else \
        f"the seccomp filter did not install (status {status}): kernel without CONFIG_SECCOMP_FILTER?"


def _memory_bound(slots, cfg: dict) -> dict:
    if slots.active:
        return {"cgroup": slots.version, "bound": "one memory cgroup per call: memory_mb in all (processes, "
                "page cache, tmpfs, SysV shm, memfds, kernel memory)"}
    return {"cgroup": None, "why": slots.why,
            "bound": "no memory cgroup: per process RLIMIT_AS memory_mb (so max_processes x memory_mb of address "
                     "space) + disk_mb of tmpfs + SysV shm up to memory_mb (the call's IPC namespace's shmmax/shmall)"
                     " + small message queues; memfd_create refused"}


def _take(uid_base: int, uid_count: int) -> tuple[int, int]:
    """A uid and a cgroup slot no call in flight holds: the uids in turn (a fresh one per call), the lowest free
    slot (few cgroups made, each reused once its call has ended). With every one taken, wait for a call to end."""
    global _next
    while True:
        uids = {u for u, _ in _live.values()}
        slots = {s for _, s in _live.values()}
        for _ in range(uid_count):
            k = _next % uid_count
            _next += 1
            if uid_base + k not in uids:
                return uid_base + k, min(set(range(len(slots) + 1)) - slots)
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
    """Stop every call in flight (its supervisor's group and its uid's processes), remove the cgroups, leave."""
    for pid, (uid, _) in list(_live.items()):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if _MODE == "root":
            supervise.sweep(uid)
    _reap_supervisors(block=True)
    if _calls_dir is not None:  # unsandboxed calls' directories, of calls killed here too
        import shutil

        shutil.rmtree(_calls_dir, ignore_errors=True)
    if _slots is not None and _slots.active:
        deadline = time.monotonic() + 2.0
        while True:  # a killed call's cgroup empties once its processes are reaped
            _slots.remove_all()
            if not _slots.made or time.monotonic() > deadline:
                break
            time.sleep(0.01)
    os._exit(0)


def _raise_oom_score() -> None:
    """Above the trainer: the host's OOM killer takes the sandbox before it (each call's runner sets 1000)."""
    try:
        with open("/proc/self/oom_score_adj") as f:
            mine = int(f.read())
        kernel.write("/proc/self/oom_score_adj", str(min(1000, max(mine + 1, 500))))
    except OSError:
        pass


class _Spares:
    """The next call's supervisor, forked (and set up) before the call comes; the zygote hands it the call's
    socket, which is all it ever sees of a call."""

    def __init__(self, ctrl: socket.socket, state: dict, ctx: dict, uid_base: int, uid_count: int):
        self.ctrl, self.state, self.ctx, self.uid_base, self.uid_count = ctrl, state, ctx, uid_base, uid_count
        self.spare: tuple[int, socket.socket] | None = None

    def _fork(self) -> tuple[int, socket.socket]:
        uid, slot = _take(self.uid_base, self.uid_count)
        if _slots.active:
            try:
                _slots.ensure(slot)
            except OSError:
                pass  # the supervisor answers with the error
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            self.ctrl.close()
            ours.close()
            supervise.main(theirs.detach(), dict(self.ctx, uid=uid if self.state["mode"] == "root" else -1,
                                                 slot=slot), _slots, _wake)
        theirs.close()
        _live[pid] = (uid, slot)
        return pid, ours

    def refill(self) -> None:
        if self.spare is not None and self.spare[0] not in _live:  # it died (killed from outside)
            self.spare[1].close()
            self.spare = None
        if self.spare is None:
            self.spare = self._fork()

    def hand(self, fd: int) -> None:
        """The call's socket to the spare (closed here before the next fork: the caller's EOF must come from its
        supervisor alone), then a new spare for the next call."""
        try:
            for _ in range(2):
                self.refill()
                pid, chan = self.spare
                self.spare = None
                try:
                    socket.send_fds(chan, [b"c"], [fd])
                    break
                except OSError:
                    pass
                finally:
                    chan.close()
        finally:
            os.close(fd)
        self.refill()


def _serve(ctrl: socket.socket, parent: int, spares: _Spares) -> None:
    wake_r = _wake[0]
    spares.refill()
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
            msg, fds, _, _ = socket.recv_fds(ctrl, 16, 1)
        except OSError:
            msg, fds = b"", []
        if not msg:  # the Sandbox closed (or its process died)
            _stop()
        for fd in fds[1:]:
            os.close(fd)
        if fds:
            spares.hand(fds[0])


def main() -> None:
    global _slots, _MODE, _calls_dir
    ctrl_fd, cfg = int(sys.argv[1]), json.loads(sys.argv[2])
    # This zygote's uids: a slice of its own, by its pid (no two live zygotes share one: other sandboxes, Ray
    # actors, other runs on the machine), since a call's uid must be its alone (the sweep kills all of its uid).
    uid_base = cfg["uid_space"] + (os.getpid() % (1 << 22)) * cfg["uid_count"]
    parent = os.getppid()
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer decides when the sandbox ends
    # The parent-death signal fires when the parent's *thread* that started us ends (a pool thread), not only the
    # process, so it only wakes the loop, which checks getppid(); the control socket's EOF says it too.
    signal.signal(signal.SIGHUP, lambda *_: None)
    kernel.prctl(kernel.PR_SET_PDEATHSIG, signal.SIGHUP)
    if os.getppid() != parent:
        os._exit(0)
    _raise_oom_score()
    _slots = cgroup.Slots()  # before the pivot: the cgroup file system is not in the new root
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last_cap = int(f.read())
    why_no_filter = _probe_seccomp()
    state = _isolate(cfg)
    state["filter"] = not why_no_filter
    if why_no_filter:
        state["why"].append(why_no_filter)
    state["memory"] = _memory_bound(_slots, cfg)
    _MODE = state["mode"]
    under_tmp = [p for p in state["binds"] if p.startswith("/tmp/")]  # each call's /tmp covers them
    if not state["fs"]:
        import tempfile

        _calls_dir = tempfile.mkdtemp(prefix="megappo-sandbox-")
    ctx = {"mode": state["mode"], "fs": state["fs"], "cgroup": _slots.active, "last_cap": last_cap,
           "under_tmp": under_tmp, "disk_mb": cfg["disk_mb"], "calls_dir": _calls_dir,
           "filter": seccomp.compile_filter(block_memfd=not _slots.active) if state["filter"] else None}
    print(json.dumps(state), flush=True)
    # Each fork copies what it touches (copy-on-write): the collector walking every object of the zygote in each
    # child would touch it all. Frozen objects are never walked; what the runner needs is imported once here.
    import gc
    import traceback  # (a failing call's traceback)
    import types

    del traceback, types  # (imported for the runner: they stay in sys.modules)
    gc.freeze()
    ctrl = socket.socket(fileno=ctrl_fd)
    wake_r, wake_w = _wake[:] = os.pipe()
    for fd in (wake_r, wake_w):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_w)  # a supervisor's exit wakes the loop: reaped at once, not at the next poll
    signal.signal(signal.SIGCHLD, lambda *_: None)
    _serve(ctrl, parent, _Spares(ctrl, state, ctx, uid_base, cfg["uid_count"]))


if __name__ == "__main__":
    main()
