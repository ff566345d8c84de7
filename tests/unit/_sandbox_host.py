"""What the sandbox's attack tests check on the machine: the state a call must leave unchanged."""
from __future__ import annotations

import os
import time

import psutil

from megappo.sandbox import UID_SLICE, UID_SPACE, Sandbox

UID_BASE, UID_COUNT = UID_SPACE, (1 << 22) * UID_SLICE  # every sandbox's call uids (root mode)
# ctypes' libc for the attacking code, its errno kept
libc_prelude = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n"


def sandbox_processes() -> list[psutil.Process]:
    """Live processes running as a sandbox uid (the per-call uids)."""
    found = []
    for p in psutil.process_iter(["uids", "status"]):
        try:
            if UID_BASE <= p.info["uids"].real < UID_BASE + UID_COUNT and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.Error, TypeError):
            continue
    return found


def busy_children(zygote_pid: int) -> list[psutil.Process]:
    """The zygote's live descendants but its spare: the next call's supervisor and runner, set up before the call
    comes (the newest child, with at most its runner under it, both still running as the zygote's user)."""
    try:
        z = psutil.Process(zygote_pid)
        kids = [c for c in z.children() if c.status() != psutil.STATUS_ZOMBIE]
    except psutil.Error:
        return []
    out = []
    spare = max(kids, key=lambda c: (c.create_time(), c.pid), default=None)
    for c in kids:
        try:
            sub = [g for g in c.children(recursive=True) if g.status() != psutil.STATUS_ZOMBIE]
            if c is spare and len(sub) <= 1 and all(g.uids().real == z.uids().real for g in sub):
                continue
            out += [c] + sub
        except psutil.Error:
            continue
    return out


def spare_runner(zygote_pid: int) -> set[int]:
    """The pid of the spare's runner (it waits in its call's cgroup before the call comes), if any."""
    try:
        kids = psutil.Process(zygote_pid).children()
        spare = max(kids, key=lambda c: (c.create_time(), c.pid))
        return {g.pid for g in spare.children()}
    except (psutil.Error, ValueError):
        return set()


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _cgroup_dir() -> str | None:
    for line in _read("/proc/self/cgroup").splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return "/sys/fs/cgroup/memory" + path
    return None


class HostState:
    """SysV IPC objects, keys, mounts, /tmp's entries and the sandbox's cgroups as this process sees them."""

    def __init__(self, **parts):
        self.parts = parts

    @classmethod
    def take(cls, sb: Sandbox) -> "HostState":
        return cls(ipc={k: _read(f"/proc/sysvipc/{k}") for k in ("shm", "msg", "sem")},
                   keys=set(_read("/proc/keys").splitlines()), mounts=_read("/proc/self/mountinfo"),
                   tmp=set(os.listdir("/tmp")), shmem=_meminfo("Shmem"))

    @staticmethod
    def slot_dirs(sb: Sandbox) -> list[str]:
        """The sandbox's memory cgroups (named after its zygote)."""
        d = _cgroup_dir()
        if d is None or not os.path.isdir(d) or sb.zygote_pid is None:
            return []
        return [os.path.join(d, n) for n in os.listdir(d) if n.startswith(f"megappo-sbx-{sb.zygote_pid}-")]

    @staticmethod
    def wait_gone(dirs: list[str], timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while any(os.path.exists(d) for d in dirs) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not any(os.path.exists(d) for d in dirs), [d for d in dirs if os.path.exists(d)]

    def assert_unchanged(self, sb: Sandbox, timeout: float = 5.0) -> None:
        """Every part back as it was (a call's namespaces and keys are freed just after it ends)."""
        deadline = time.monotonic() + timeout
        while True:
            problems = self._problems(sb)
            if not problems or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert not problems, problems

    def _problems(self, sb: Sandbox) -> list[str]:
        now = HostState.take(sb).parts
        out = []
        if now["ipc"] != self.parts["ipc"]:
            out.append(f"SysV IPC changed: {now['ipc']}")
        if now["keys"] - self.parts["keys"]:
            out.append(f"keys added: {now['keys'] - self.parts['keys']}")
        if now["mounts"] != self.parts["mounts"]:
            out.append("mounts changed")
        new_tmp = [n for n in now["tmp"] - self.parts["tmp"] if _owned_by_a_call(os.path.join("/tmp", n))]
        if new_tmp:
            out.append(f"files left in /tmp: {new_tmp}")
        if now["shmem"] - self.parts["shmem"] > 64 << 20:
            out.append(f"shared memory grew by {(now['shmem'] - self.parts['shmem']) >> 20} MB")
        left = sandbox_processes()
        if left:
            out.append(f"processes left: {[(p.pid, p.info['uids'].real) for p in left]}")
        busy = busy_children(sb.zygote_pid) if sb.zygote_pid else []
        if busy:
            out.append(f"the zygote has calls still running: {busy}")
        spare = {str(p) for p in spare_runner(sb.zygote_pid)} if sb.zygote_pid else set()
        for d in HostState.slot_dirs(sb):
            tasks = _read(os.path.join(d, "cgroup.procs")).split()
            if set(tasks) - spare:
                out.append(f"cgroup {d} holds {tasks}")
        return out


def _owned_by_a_call(path: str) -> bool:
    """A file a call could have made: owned by a call's uid, or, unprivileged, named like the sandbox's."""
    try:
        uid = os.lstat(path).st_uid
    except OSError:
        return False
    return UID_BASE <= uid < UID_BASE + UID_COUNT or os.path.basename(path).startswith(("megappo-sandbox", "fill"))


def _meminfo(key: str) -> int:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


# for the attacking code: whether the bytes a then b, contiguous, are anywhere in its own memory
SCAN = """
def find(a, b):
    '''Whether a then b, contiguous, is anywhere in this process's readable memory.'''
    n = 0
    with open('/proc/self/maps') as maps, open('/proc/self/mem', 'rb', 0) as mem:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split('-'))
            if 'r' not in line.split()[1] or line.rstrip().endswith(('[vvar]', '[vsyscall]', '[vvar_vclock]')):
                continue
            for start in range(lo, hi, 1 << 22):
                try:
                    mem.seek(start)
                    chunk = mem.read(min(1 << 22, hi - start) + len(a) + len(b))
                except (OSError, OverflowError, ValueError):
                    continue
                i = chunk.find(a)
                while i >= 0:
                    if chunk[i + len(a):i + len(a) + len(b)] == b:
                        n += 1
                    i = chunk.find(a, i + 1)
    return n
"""
