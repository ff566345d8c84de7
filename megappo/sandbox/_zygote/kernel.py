"""Thin ctypes wrappers over the Linux calls the sandbox needs, and the loader of its sibling modules."""
from __future__ import annotations

import ctypes
import importlib.util
import os
import sys

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x02000000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
CLONE_NEW_ANY = (CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID
                 | CLONE_NEWNET)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP = 1, 4, 24
PR_SET_NO_NEW_PRIVS, PR_SET_CHILD_SUBREAPER, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 36, 47, 4
KEYCTL_JOIN_SESSION_KEYRING = 1
# statvfs f_flag bit -> the mount flag a bind remount must keep (a user namespace locks them: dropping is refused)
_KEPT = {2: MS_NOSUID, 4: MS_NODEV, 8: MS_NOEXEC, 1024: 1024, 2048: 2048, 4096: 1 << 21}

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
HERE = os.path.dirname(os.path.abspath(__file__))


def load(name: str):
    """A sibling module by path (the zygote runs with `python -I`: this directory is not on sys.path)."""
    full = f"_megappo_sandbox_{name}"
    if full in sys.modules:
        return sys.modules[full]
    spec = importlib.util.spec_from_file_location(full, os.path.join(HERE, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[full] = mod
    spec.loader.exec_module(mod)
    return mod


def check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _enc(s):
    return s.encode() if isinstance(s, str) else s


def mount(src, target, fstype, flags, data=None) -> None:
    check(libc.mount(_enc(src), _enc(target), _enc(fstype), flags, _enc(data)), f"mount {target}")


def umount(target: str) -> None:
    check(libc.umount2(_enc(target), MNT_DETACH), f"umount {target}")


def unshare(flags: int, what: str) -> None:
    check(libc.unshare(flags), f"unshare({what})")


def pivot_root(new: str, old: str) -> None:
    nr = {"x86_64": 155, "aarch64": 41}.get(os.uname().machine)
    if nr is None:
        raise OSError(38, f"pivot_root: unknown syscall number on {os.uname().machine}")
    check(libc.syscall(nr, _enc(new), _enc(old)), "pivot_root")


def kept_flags(path: str) -> int:
    """The per-mount flags of the mount at `path` that a read-only bind remount must repeat."""
    f = os.statvfs(path).f_flag
    return sum(ms for st, ms in _KEPT.items() if f & st)


def prctl(option: int, arg2: int = 0, what: str = "prctl") -> None:
    check(libc.prctl(option, ctypes.c_ulong(arg2), 0, 0, 0), what)


def write(path: str, text: str, dir_fd=None) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
