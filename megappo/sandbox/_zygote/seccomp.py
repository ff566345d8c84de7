"""A seccomp-BPF filter, hand-assembled: the calls that could leave the sandbox's namespaces, reach the kernel's
attack surface or other processes fail; all else is allowed.

Refused with EPERM: new namespaces (unshare, setns, clone with a CLONE_NEW* flag), mounts and the new mount API,
chroot, keyrings, bpf, perf_event_open, userfaultfd, ptrace and process_vm_*, pidfd_getfd, kexec, modules,
io_uring, file handles (open_by_handle_at walks past any root), swap, reboot, quotas, syslog, acct, fanotify,
hostname changes, personality, memfd_secret, and memfd_create where no memory cgroup bounds it. clone3 answers
ENOSYS (its flags sit in memory the filter cannot read), so glibc falls back to clone. socket() and socketpair()
outside AF_UNIX, AF_INET and AF_INET6 answer EAFNOSUPPORT (AF_VSOCK reaches a VM's host past any network
namespace). A call from another ABI (i386, x32) kills the process.
"""
from __future__ import annotations

import ctypes
import errno
import os

from _megappo_sandbox_kernel import PR_SET_NO_NEW_PRIVS, libc, prctl  # noqa: E402  (loaded by kernel.load)

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_COMMON = {"move_mount": 429, "open_tree": 428, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
           "mount_setattr": 442, "open_tree_attr": 467, "io_uring_setup": 425, "io_uring_enter": 426,
           "io_uring_register": 427, "pidfd_getfd": 438, "quotactl_fd": 443, "memfd_secret": 447}
SYSCALLS = {
    "x86_64": dict(_COMMON, unshare=272, setns=308, clone=56, clone3=435, mount=165, umount2=166, pivot_root=155,
                   chroot=161, keyctl=250, add_key=248, request_key=249, bpf=321, perf_event_open=298,
                   userfaultfd=323, ptrace=101, process_vm_readv=310, process_vm_writev=311, kexec_load=246,
                   kexec_file_load=320, init_module=175, finit_module=313, delete_module=176,
                   name_to_handle_at=303, open_by_handle_at=304, swapon=167, swapoff=168, reboot=169,
                   quotactl=179, syslog=103, acct=163, fanotify_init=300, sethostname=170, setdomainname=171,
                   personality=135, memfd_create=319, iopl=172, ioperm=173, uselib=134, lookup_dcookie=212,
                   vhangup=153, socket=41, socketpair=53),
    "aarch64": dict(_COMMON, unshare=97, setns=268, clone=220, clone3=435, mount=40, umount2=39, pivot_root=41,
                    chroot=51, keyctl=219, add_key=217, request_key=218, bpf=280, perf_event_open=241,
                    userfaultfd=282, ptrace=117, process_vm_readv=270, process_vm_writev=271, kexec_load=104,
                    kexec_file_load=294, init_module=105, finit_module=273, delete_module=106,
                    name_to_handle_at=264, open_by_handle_at=265, swapon=224, swapoff=225, reboot=142,
                    quotactl=60, syslog=116, acct=89, fanotify_init=262, sethostname=161, setdomainname=162,
                    personality=92, memfd_create=279, lookup_dcookie=18, vhangup=58, socket=198, socketpair=199),
}
_SPECIAL = ("clone", "clone3", "socket", "socketpair", "memfd_create")
ALLOWED_FAMILIES = (1, 2, 10)  # AF_UNIX, AF_INET, AF_INET6
CLONE_NEW_FLAGS = 0x7E020000  # CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET
X32_BIT = 0x40000000

LD_W_ABS, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
RET_KILL_PROCESS, RET_ERRNO, RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
OFF_NR, OFF_ARCH, OFF_ARG0 = 0, 4, 16  # struct seccomp_data; args[0]'s low word (little-endian)
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2


class _Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Filter))]


def supported(machine: str | None = None) -> bool:
    return (machine or os.uname().machine) in SYSCALLS


def program(block_memfd: bool, machine: str | None = None) -> list[tuple[int, int, int, int]]:
    """The filter's instructions (code, jt, jf, k) for `machine` (this one by default)."""
    machine = machine or os.uname().machine
    nrs = SYSCALLS[machine]
    eperm = (RET, 0, 0, RET_ERRNO | errno.EPERM)
    prog = [(LD_W_ABS, 0, 0, OFF_ARCH), (JEQ, 1, 0, AUDIT_ARCH[machine]), (RET, 0, 0, RET_KILL_PROCESS),
            (LD_W_ABS, 0, 0, OFF_NR)]
    if machine == "x86_64":
        prog += [(JGE, 0, 1, X32_BIT), (RET, 0, 0, RET_KILL_PROCESS)]
    denied = [nr for name, nr in nrs.items() if name not in _SPECIAL]
    if block_memfd:
        denied.append(nrs["memfd_create"])
    for nr in sorted(set(denied)):
        prog += [(JEQ, 0, 1, nr), eperm]
    prog += [(JEQ, 0, 1, nrs["clone3"]), (RET, 0, 0, RET_ERRNO | errno.ENOSYS)]
    # socket(family, ...) and socketpair(family, ...): the family is args[0]
    fam = ALLOWED_FAMILIES
    prog += [(JEQ, 1, 0, nrs["socket"]), (JEQ, 0, 2 + len(fam) + 1, nrs["socketpair"]), (LD_W_ABS, 0, 0, OFF_ARG0)]
    prog += [(JEQ, len(fam) - i, 0, f) for i, f in enumerate(fam)]
    prog += [(RET, 0, 0, RET_ERRNO | errno.EAFNOSUPPORT), (RET, 0, 0, RET_ALLOW)]
    # clone(flags, ...): any CLONE_NEW* flag
    prog += [(JEQ, 0, 3, nrs["clone"]), (LD_W_ABS, 0, 0, OFF_ARG0), (JSET, 0, 1, CLONE_NEW_FLAGS), eperm,
             (RET, 0, 0, RET_ALLOW)]
    return prog


def compile_filter(block_memfd: bool) -> tuple:
    """The filter for this machine, ready for `install` (built once in the zygote: each call only installs it)."""
    ins = program(block_memfd)
    arr = (_Filter * len(ins))(*[_Filter(*i) for i in ins])
    return _Prog(len(ins), arr), arr


def install(compiled: tuple) -> None:
    """no_new_privs, then the filter on this thread (the runner is single-threaded here); irreversible."""
    prctl(PR_SET_NO_NEW_PRIVS, 1, what="PR_SET_NO_NEW_PRIVS")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(compiled[0]), 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"seccomp filter: {os.strerror(err)}")
