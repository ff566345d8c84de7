"""The calls' file system: an allow-list root, built once by the zygote.

A tmpfs becomes the root (pivot_root; the machine's root is detached), holding only read-only binds of what the
interpreter needs (its prefixes, executable and sys.path, the system's /usr, /lib*, /bin, /sbin, LD_LIBRARY_PATH)
and of the `readable` paths the config names; generated /etc files (passwd and group with the call's user,
nsswitch.conf, hosts; ld.so.cache and localtime copied); /dev with null, zero, full, random and urandom only;
/proc (each call mounts its own over it); an empty /tmp (each call mounts its own tmpfs there). Each call's mount
namespace is a copy of this one. Nothing else of the machine (/sys, /run, /home, /root, /work, the run's files)
is in it.
"""
from __future__ import annotations

import os
import sys

from _megappo_sandbox_kernel import (MS_BIND, MS_NODEV, MS_NOEXEC, MS_NOSUID, MS_PRIVATE, MS_RDONLY, MS_REC,  # noqa
                                     MS_REMOUNT, kept_flags, mount, pivot_root, umount)

SYSTEM = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin")
DEVICES = ("null", "zero", "full", "random", "urandom")
CALL_UID = 1000  # the code's uid (and gid) inside its user namespace
ETC = {"passwd": f"root:x:0:0:root:/root:/bin/sh\nsandbox:x:{CALL_UID}:{CALL_UID}:sandbox:/tmp/work:/bin/sh\n"
                 "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
       "group": f"root:x:0:\nsandbox:x:{CALL_UID}:\nnogroup:x:65534:\n",
       "nsswitch.conf": "passwd: files\ngroup: files\nhosts: files\n",
       "hosts": "127.0.0.1 localhost\n::1 localhost\n", "hostname": "sandbox\n"}
COPIED = ("/etc/ld.so.cache", "/etc/localtime")


def interpreter_paths() -> list[str]:
    """What the interpreter needs, as real paths: its prefixes, executable's directory and sys.path entries, and
    LD_LIBRARY_PATH's directories."""
    paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.realpath(sys.executable)), *sys.path,
             *os.environ.get("LD_LIBRARY_PATH", "").split(":")]
    return sorted({os.path.realpath(p) for p in paths if p and os.path.exists(p)} - {"/"})


def tops(paths: list[str]) -> list[str]:
    """`paths` without those under another of them."""
    paths = sorted(set(paths))
    return [p for k, p in enumerate(paths) if not any((p + "/").startswith(q + "/") for q in paths[:k])]


def _bind(fd: int, target: str, flags: int) -> None:
    """Bind the path open as `fd` at `target`, then remount it with `flags` (plus those the mount must keep)."""
    src = f"/proc/self/fd/{fd}"
    try:
        mount(src, target, None, MS_BIND)
    except OSError:  # a mount with locked submounts (a user namespace) binds only with them
        mount(src, target, None, MS_BIND | MS_REC)
    mount(None, target, None, MS_REMOUNT | MS_BIND | flags | kept_flags(target))


def _placeholder(path: str, is_dir: bool) -> None:
    if is_dir:
        os.makedirs(path, 0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(path), 0o755, exist_ok=True)
        if not os.path.exists(path):
            open(path, "w").close()


def build(readable: list[str], stage: str = "/tmp") -> list[str]:
    """Pivot into a fresh allow-list root (this process must have a private mount namespace of its own). Returns
    what was bound read-only."""
    mount("none", "/", None, MS_REC | MS_PRIVATE)
    binds = tops([p for p in SYSTEM if os.path.isdir(p) and not os.path.islink(p)] + interpreter_paths()
                  + [os.path.realpath(p) for p in readable])
    links = {p: os.readlink(p) for p in SYSTEM if os.path.islink(p)}
    # handles on the sources before the tmpfs hides what is under `stage`
    fds = {p: os.open(p, os.O_PATH | os.O_CLOEXEC) for p in binds}
    devs = {d: os.open(f"/dev/{d}", os.O_PATH | os.O_CLOEXEC) for d in DEVICES if os.path.exists(f"/dev/{d}")}
    proc = os.open("/proc", os.O_PATH | os.O_CLOEXEC)
    etc = {}
    for p in COPIED:
        try:
            with open(p, "rb") as f:
                etc[os.path.basename(p)] = f.read()
        except OSError:
            pass
    mount("tmpfs", stage, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=0755")
    new = lambda p: stage + p  # noqa: E731
    try:
        for p in binds:
            _placeholder(new(p), os.path.isdir(f"/proc/self/fd/{fds[p]}"))
            _bind(fds[p], new(p), MS_RDONLY | MS_NOSUID | MS_NODEV)
        for p, target in links.items():
            os.symlink(target, new(p))
        os.makedirs(new("/etc"), 0o755, exist_ok=True)
        for name, text in ETC.items():
            with open(new(f"/etc/{name}"), "w") as f:
                f.write(text)
        for name, data in etc.items():
            with open(new(f"/etc/{name}"), "wb") as f:
                f.write(data)
        os.makedirs(new("/dev/shm"), 0o755)
        for d, fd in devs.items():
            _placeholder(new(f"/dev/{d}"), False)
            _bind(fd, new(f"/dev/{d}"), MS_NOSUID | MS_NOEXEC)
        for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                             ("stderr", "/proc/self/fd/2")):
            os.symlink(target, new(f"/dev/{name}"))
        os.makedirs(new("/proc"), 0o555)
        mount(f"/proc/self/fd/{proc}", new("/proc"), None, MS_BIND | MS_REC)
        os.makedirs(new("/tmp"), 0o1777, exist_ok=True)
        os.chmod(new("/tmp"), 0o1777)
        os.mkdir(new("/.old"))
    finally:
        for fd in [*fds.values(), *devs.values(), proc]:
            os.close(fd)
    os.chdir(stage)
    pivot_root(".", ".old")
    os.chdir("/")
    umount("/.old")
    os.rmdir("/.old")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    return binds


def writable_mounts() -> list[str]:
    """Mount points still writable, but for the devices and /proc (each call mounts its own /proc over it)."""
    allowed = {f"/dev/{d}" for d in DEVICES}
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            r = line.split()
            point = r[4].encode().decode("unicode_escape")
            if "rw" in r[5].split(",") and point not in allowed and not (point + "/").startswith("/proc/"):
                out.append(point)
    return out


def cover_tmp(size_mb: int, uid: int, inside: list[str]) -> str:
    """The call's own tmpfs on /tmp (its working directory /tmp/work, also HOME and TMPDIR, and /dev/shm), with
    `inside`, the interpreter's directories under /tmp (a venv there), bound back in; returns the working
    directory."""
    fds = {p: os.open(p, os.O_PATH | os.O_CLOEXEC) for p in inside}
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={size_mb}m,mode=0755")
    for p, fd in fds.items():
        _placeholder(p, os.path.isdir(f"/proc/self/fd/{fd}"))
        _bind(fd, p, MS_RDONLY | MS_NOSUID | MS_NODEV)
        os.close(fd)
    for d in ("/tmp/work", "/tmp/.shm"):
        os.mkdir(d, 0o700)
        if uid >= 0:
            os.chown(d, uid, uid)
    mount("/tmp/.shm", "/dev/shm", None, MS_BIND)
    return "/tmp/work"
