"""One memory cgroup per call slot: the call's total bound (processes, page cache, tmpfs, SysV shm, memfds, kernel
memory all charge to the cgroup of the process that touches the pages).

Slots are child cgroups of this process's own memory cgroup, `megappo-sbx-<zygote pid>-<slot>`, made at a slot's
first use, reused by a later call only once the call that held it has ended (its processes gone), and removed when
the zygote stops. cgroup v1: memory.limit_in_bytes and memory.memsw.limit_in_bytes (no swap past the bound), the
OOM kills counted in memory.oom_control. cgroup v2: memory.max, memory.swap.max 0, memory.events' oom_kill, where
this cgroup's cgroup.subtree_control has (or takes) the memory controller.
"""
from __future__ import annotations

import os

from _megappo_sandbox_kernel import write  # noqa: E402  (loaded by kernel.load)

PREFIX = "megappo-sbx-"


def _find() -> tuple[str | None, str | None, str]:
    """(version, the directory of this process's memory cgroup, why not) from /proc/self/{cgroup,mountinfo}."""
    with open("/proc/self/cgroup") as f:
        rows = [line.rstrip("\n").split(":", 2) for line in f]
    v1 = next((r[2] for r in rows if "memory" in r[1].split(",")), None)
    v2 = next((r[2] for r in rows if r[0] == "0" and r[1] == ""), None)
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    for m in mounts:
        sep = m.index("-")
        fstype, opts = m[sep + 1], m[sep + 3].split(",")
        root, point = m[3], m[4].encode().decode("unicode_escape")
        if fstype == "cgroup" and "memory" in opts and v1 is not None:
            version, path = "v1", v1
        elif fstype == "cgroup2" and v2 is not None and v1 is None:
            version, path = "v2", v2
        else:
            continue
        if root != "/" and not (path + "/").startswith(root.rstrip("/") + "/"):
            continue
        rel = path if root == "/" else path[len(root.rstrip("/")):]
        return version, point.rstrip("/") + rel, ""
    return None, None, "no memory cgroup controller mounted"


class Slots:
    """The zygote's memory cgroups. `dir_fd` stays open across pivot_root (the cgroup file system is not in the
    calls' root)."""

    def __init__(self):
        self.version, path, self.why = _find()
        self.owner = os.getpid()
        self.dir_fd = None
        self.made: set[int] = set()
        if path is None:
            return
        try:
            self.dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            if self.version == "v2":
                self._enable_v2()
            self._remove_stale()
            probe = self.name(-1)
            os.mkdir(probe, dir_fd=self.dir_fd)
            ok = self._files(probe)
            os.rmdir(probe, dir_fd=self.dir_fd)
            if not ok:
                raise OSError("its memory limit files are missing")
        except OSError as e:
            self.why = f"cannot make a memory cgroup under {path}: {e}"
            self.close()

    def _enable_v2(self) -> None:
        with open(os.open("cgroup.subtree_control", os.O_RDONLY, dir_fd=self.dir_fd)) as f:
            if "memory" in f.read().split():
                return
        write("cgroup.subtree_control", "+memory", dir_fd=self.dir_fd)  # EBUSY where this cgroup holds processes

    def _files(self, name: str) -> bool:
        want = "memory.limit_in_bytes" if self.version == "v1" else "memory.max"
        try:
            os.stat(f"{name}/{want}", dir_fd=self.dir_fd)
            return True
        except FileNotFoundError:
            return False

    def _remove_stale(self) -> None:
        """Slots of zygotes that died without removing them (SIGKILL): empty, so rmdir takes them."""
        for name in os.listdir(self.dir_fd):
            if name.startswith(PREFIX):
                pid = name[len(PREFIX):].split("-")[0]
                if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                    try:
                        os.rmdir(name, dir_fd=self.dir_fd)
                    except OSError:
                        pass

    @property
    def active(self) -> bool:
        return self.dir_fd is not None

    def name(self, slot: int) -> str:
        return f"{PREFIX}{self.owner}-{slot}"

    def ensure(self, slot: int) -> None:
        """The slot's cgroup exists (the zygote makes it at first use: its own record of slots is the one kept)."""
        if slot not in self.made:
            try:
                os.mkdir(self.name(slot), 0o700, dir_fd=self.dir_fd)
            except FileExistsError:
                pass
            self.made.add(slot)

    def procs_fd(self, slot: int) -> int:
        """An fd on the slot's cgroup.procs: the runner joins by writing "0" to it."""
        return os.open(f"{self.name(slot)}/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC, dir_fd=self.dir_fd)

    def limit(self, slot: int, limit_bytes: int) -> int:
        """Set the slot's limit; returns its OOM kills so far."""
        name = self.name(slot)
        if self.version == "v1":
            # memsw >= limit at every step: raise memsw first when growing, lower the limit first when shrinking
            files = ["memory.memsw.limit_in_bytes", "memory.limit_in_bytes"]
            try:
                for f in files:
                    write(f"{name}/{f}", str(limit_bytes), dir_fd=self.dir_fd)
            except OSError:
                for f in reversed(files):
                    try:
                        write(f"{name}/{f}", str(limit_bytes), dir_fd=self.dir_fd)
                    except FileNotFoundError:
                        pass  # no swap accounting: memory.memsw.* absent
        else:
            write(f"{name}/memory.max", str(limit_bytes), dir_fd=self.dir_fd)
            try:
                write(f"{name}/memory.swap.max", "0", dir_fd=self.dir_fd)
            except FileNotFoundError:
                pass
        return self.oom_kills(slot)

    def oom_kills(self, slot: int) -> int:
        """How many processes the slot's OOM killer has killed, ever."""
        f = "memory.oom_control" if self.version == "v1" else "memory.events"
        fd = os.open(f"{self.name(slot)}/{f}", os.O_RDONLY, dir_fd=self.dir_fd)
        with open(fd) as fh:
            for line in fh:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

    def remove_all(self) -> None:
        """rmdir every slot made; those still busy (a killed call's processes not yet gone) stay in `made`."""
        for slot in sorted(self.made):
            try:
                os.rmdir(self.name(slot), dir_fd=self.dir_fd)
            except FileNotFoundError:
                pass
            except OSError:
                continue
            self.made.discard(slot)

    def close(self) -> None:
        if self.dir_fd is not None:
            os.close(self.dir_fd)
            self.dir_fd = None
