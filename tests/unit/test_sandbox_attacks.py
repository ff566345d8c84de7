"""The sandbox against a hostile program that has read megappo's source: each attack fails, the call answers
clearly, and the machine is unchanged afterwards (no process of a call's uid, no SysV IPC object, no key, no
mount, no file in /tmp, no cgroup with a task; after close, no cgroup at all). Real kernel features, no mocks."""
from __future__ import annotations

import os
import socket
import threading
import time
import uuid

import pytest

from megappo.multi_turn.python_tool import PythonTool
from megappo.sandbox import Limits, Sandbox, SandboxUnavailable

from _sandbox_host import SCAN, HostState, libc_prelude, sandbox_processes

pytestmark = [pytest.mark.timeout(120), pytest.mark.alone]  # its host checks see the whole machine
SECRET = f"megappo-secret-{uuid.uuid4().hex}"
LIMITS = Limits(timeout_s=5, cpu_s=4, memory_mb=192, max_processes=16, max_file_mb=64, disk_mb=32)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def sb():
    os.environ["MEGAPPO_ATTACK_SECRET"] = SECRET  # the trainer's environment: the code must never see it
    try:
        box = Sandbox(LIMITS).start()
    except SandboxUnavailable as e:
        pytest.skip(f"this machine cannot isolate the code: {e}")
    finally:
        del os.environ["MEGAPPO_ATTACK_SECRET"]
    yield box
    slots = HostState.slot_dirs(box)
    box.close()
    assert not sandbox_processes()
    HostState.wait_gone(slots)


@pytest.fixture
def host(sb):
    """The machine's state before the attack; checked unchanged after it."""
    state = HostState.take(sb)
    yield state
    state.assert_unchanged(sb)


def go(sb: Sandbox, code: str, limits: Limits = LIMITS):
    res = sb.run(libc_prelude + code, limits)
    assert res.error is None, res
    return res


def lines(res) -> dict[str, str]:
    """'key: value' lines of the code's stdout."""
    return dict(line.split(": ", 1) for line in res.stdout.splitlines() if ": " in line)


# --- memory ---------------------------------------------------------------------------------------------------
def test_sysv_shm_and_message_queue_left_behind(sb, host):
    """A 1 GB segment is refused; a smaller one and a queue die with the call's IPC namespace: the next call (and
    the machine) find neither."""
    res = go(sb, """
big = libc.shmget(0, 1 << 30, 0o1600)
print('big:', big, ctypes.get_errno())
shm = libc.shmget(0x4D45, 64 << 20, 0o1666)
libc.shmat.restype = ctypes.c_void_p
addr = libc.shmat(shm, None, 0)
ctypes.memset(addr, 0x41, 64 << 20)
q = libc.msgget(0x4D46, 0o1666)
msg = ctypes.create_string_buffer(b'\\x01\\x00\\x00\\x00\\x00\\x00\\x00\\x00secret', 14)
print('made:', shm >= 0, addr not in (None, -1), q >= 0, libc.msgsnd(q, msg, 6, 0))
""")
    out = lines(res)
    assert out["big"] == "-1 22", res  # EINVAL: past the namespace's shmmax (memory_mb)
    assert out["made"] == "True True True 0", res
    res = go(sb, "print('next:', libc.shmget(0x4D45, 0, 0), libc.msgget(0x4D46, 0), ctypes.get_errno())")
    assert lines(res)["next"] == "-1 -1 2", res  # ENOENT: a fresh IPC namespace


@pytest.mark.parametrize("what", ["shm", "memfd", "tmpfs", "children"])
def test_memory_is_bounded_in_all(sb, host, what):
    """SysV shm filled by a child, memfds, the call's tmpfs (given more room than memory_mb) and many processes
    each under RLIMIT_AS all count against the one bound: the call's cgroup kills it (or, without one, each is
    refused: shmmax, memfd_create, disk_mb, RLIMIT_AS x max_processes)."""
    mb = LIMITS.memory_mb
    code = {
        "shm": "libc.shmat.restype = ctypes.c_void_p\n"
               f"s = libc.shmget(0, {mb - 72} << 20, 0o1600)\n"
               "if os.fork() == 0:\n"
               f"    ctypes.memset(libc.shmat(s, None, 0), 1, {mb - 72} << 20)\n    os._exit(0)\n"
               "os.wait()\nx = bytearray(100 << 20)\nprint('survived: 1')",
        "memfd": "fds = []\nfor _ in range(16):\n    fds.append(os.memfd_create('x'))\n"
                 "    for _ in range(32):\n        os.write(fds[-1], b'x' * (1 << 20))\nprint('survived: 1')",
        "tmpfs": "for i in range(8):\n    with open(f'/tmp/work/f{i}', 'wb') as f:\n        for _ in range(40):\n"
                 "            f.write(b'x' * (1 << 20))\nprint('survived: 1')",
        "children": "kids = []\nfor _ in range(6):\n    pid = os.fork()\n    if pid == 0:\n"
                    "        x = bytearray(100 << 20)\n        time.sleep(1.5)\n        os._exit(0)\n"
                    "    kids.append(pid)\nfor k in kids:\n    print('child:', os.waitpid(k, 0)[1])\n",
    }[what]
    res = go(sb, "import time\n" + code, Limits(**dict(LIMITS.__dict__, disk_mb=512)))
    if sb.state["memory"]["cgroup"]:
        assert res.memory_limited, res
        assert "survived" not in res.stdout
        if what == "children":
            assert "child: 9" in res.stdout or res.signal == 9, res  # SIGKILLed by the cgroup's OOM killer
    else:
        assert not res.memory_limited and "survived" not in res.stdout, res
        assert any(e in res.stderr for e in ("MemoryError", "Operation not permitted", "No space left")), res


def test_python_tool_says_out_of_memory(sb):
    if not sb.state["memory"]["cgroup"]:
        pytest.skip(f"no memory cgroup here: {sb.state['memory']}")
    tool = PythonTool({"timeout_s": 5, "memory_mb": 128, "disk_mb": 16}, {"type": "function", "function": {
        "name": "code_interpreter", "parameters": {"type": "object"}}})
    try:
        res = tool.execute("t", {"code": "import os\nwhile True:\n    fd = os.memfd_create('x')\n"
                                         "    for _ in range(32):\n        os.write(fd, b'x' * (1 << 20))"})
    finally:
        tool.close()
    assert "out of memory (limit 128 MB for the whole program" in res.text, res.text
    assert res.metrics["memory_limited"] == 1


def test_user_namespace_and_private_tmpfs(sb, host):
    """No new namespace of any kind: unshare, clone with CLONE_NEW*, setns, and no mount at all."""
    res = go(sb, """
for flags in (0x10000000, 0x10020000, 0x00020000, 0x40000000, 0x20000000, 0x08000000, 0x02000000):
    print('unshare', hex(flags) + ':', libc.unshare(flags), ctypes.get_errno())
print('clone:', libc.syscall(56 if os.uname().machine == 'x86_64' else 220, 0x10000000 | 17, 0, 0, 0, 0),
      ctypes.get_errno())
print('clone3:', libc.syscall(435, 0, 0), ctypes.get_errno())
fd = os.open('/proc/self/ns/net', os.O_RDONLY)
print('setns:', libc.setns(fd, 0), ctypes.get_errno())
os.mkdir('m')
print('mount:', libc.mount(b'none', b'm', b'tmpfs', 0, b'size=4g'), ctypes.get_errno())
print('unmount /proc:', libc.umount2(b'/proc', 2), ctypes.get_errno())
print('chroot:', libc.chroot(b'm'), ctypes.get_errno())
import subprocess
r = subprocess.run(['unshare', '-U', '-r', 'true'], capture_output=True, text=True)
print('unshare(1):', r.returncode)
""")
    out = lines(res)
    assert all(v == "-1 1" for k, v in out.items() if k.startswith("unshare 0x")), res  # EPERM
    for key in ("clone", "setns", "mount", "unmount /proc", "chroot"):
        assert out[key] == "-1 1", (key, res)
    assert out["clone3"] == "-1 38", res  # ENOSYS: glibc falls back to clone
    assert out["unshare(1)"] != "0", res


def test_fill_dev_shm_and_tmp(sb, host):
    res = go(sb, """
for path in ('/dev/shm/fill', '/tmp/work/fill', '/tmp/fill'):
    try:
        with open(path, 'wb') as f:
            for _ in range(64):
                f.write(b'x' * (1 << 20))
        print(path + ':', 'FILLED')
    except OSError as e:
        print(path + ':', e.strerror)
""")
    out = lines(res)
    assert out["/dev/shm/fill"] == "No space left on device", res  # disk_mb 32 in all
    assert out["/tmp/work/fill"] == "No space left on device", res
    assert not os.path.exists("/dev/shm/fill") and not os.path.exists("/tmp/fill")


# --- files ----------------------------------------------------------------------------------------------------
def test_reads_nothing_of_the_run(sb, host, tmp_path, request):
    """The repository, a run's output directory, a dataset with the answers: none is in the call's root."""
    import shutil

    run_dir = os.path.join(REPO, f"outputs-sbx-{uuid.uuid4().hex[:8]}")  # a run's output dir in the repository
    var_dir = f"/var/tmp/megappo-sbx-data-{uuid.uuid4().hex[:8]}"  # a dataset outside /tmp
    datasets = [str(tmp_path / "answers.jsonl"), os.path.join(run_dir, "metrics.jsonl"), f"{var_dir}/answers.jsonl"]
    for path in datasets:
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        with open(path, "w") as f:
            f.write(f'{{"answer": "{SECRET}"}}\n')
        os.chmod(path, 0o644)
    tmp_path.chmod(0o755)
    request.addfinalizer(lambda: (shutil.rmtree(run_dir, True), shutil.rmtree(var_dir, True)))
    paths = [*datasets, os.path.join(REPO, "README.md"), os.path.join(REPO, "megappo", "__init__.py"), REPO,
             run_dir, "/root/.ssh", "/home", "/etc/shadow", "/etc/hostname", "/sys/kernel", "/var", "/run",
             "/sys/fs/cgroup", "/work/main/megappo", "/work/main/.git", "/sys"]
    binds = sb.state["binds"]  # a path on the way to one of them exists, as an empty directory but for it
    res = go(sb, f"""
for p in {paths!r}:
    print(p + ':', os.path.exists(p))
print('etc:', sorted(os.listdir('/etc')))
print('dev:', sorted(os.listdir('/dev')))
print('root:', sorted(os.listdir('/')))
try:
    import megappo
    print('megappo:', megappo.__file__)
except ImportError as e:
    print('megappo:', 'ImportError')
""")
    out = lines(res)
    for p in paths:
        expected = str(p == "/etc/hostname" or any(b.startswith(p + "/") for b in binds))
        assert out[p] == expected, (p, res)
    assert eval(out["dev"]) == ["fd", "full", "null", "random", "shm", "stderr", "stdin", "stdout", "urandom",
                                "zero"], res
    assert set(eval(out["etc"])) <= {"group", "hostname", "hosts", "ld.so.cache", "localtime", "nsswitch.conf",
                                     "passwd"}, res
    assert out["megappo"] == "ImportError", res
    assert SECRET not in res.stdout


def test_readable_paths_are_read_only(host, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "q.txt").write_text("question")
    for p in (tmp_path, data):
        p.chmod(0o755)
    (data / "q.txt").chmod(0o644)
    with Sandbox(LIMITS, readable_paths=[str(data)]) as box:
        res = go(box, f"""
print('read:', open({str(data / 'q.txt')!r}).read())
try:
    open({str(data / 'q.txt')!r}, 'w').write('changed')
except OSError as e:
    print('write:', e.strerror)
print('parent:', sorted(os.listdir({str(tmp_path)!r})))
""")
    out = lines(res)
    assert out["read"] == "question" and out["write"] == "Read-only file system", res
    assert out["parent"] == "['data']", res
    assert (data / "q.txt").read_text() == "question"
    with pytest.raises(ValueError, match="do not exist"):
        Sandbox(LIMITS, readable_paths=[str(tmp_path / "missing")])


def test_escape_by_file_descriptors_and_handles(sb, host):
    """Only 0, 1 and 2 are open; '..' of the root is the root; no file handle, no chroot, /proc/1/root is its own
    root."""
    res = go(sb, """
print('fds:', sorted(int(f) for f in os.listdir('/proc/self/fd')))
print('links:', sorted(os.readlink(f'/proc/self/fd/{f}') for f in ('0', '1', '2')))
print('dotdot:', sorted(os.listdir('/../../..')) == sorted(os.listdir('/')))
print('proc1root:', sorted(os.listdir('/proc/1/root')) == sorted(os.listdir('/')))
buf = ctypes.create_string_buffer(136)
ctypes.memmove(buf, ctypes.c_uint32(128).__reduce__ and (128).to_bytes(4, 'little'), 4)
mount_id = ctypes.c_int()
print('name_to_handle_at:', libc.name_to_handle_at(-100, b'/usr', buf, ctypes.byref(mount_id), 0),
      ctypes.get_errno())
print('open_by_handle_at:', libc.open_by_handle_at(-100, buf, 0), ctypes.get_errno())
""")
    out = lines(res)
    assert out["fds"] in ("[0, 1, 2]", "[0, 1, 2, 3]"), res  # (3: listdir's own)
    assert "dotdot" in out and out["dotdot"] == "True" and out["proc1root"] == "True", res
    assert out["name_to_handle_at"] == "-1 1" and out["open_by_handle_at"] == "-1 1", res


def test_mknod_setuid_and_privileges(sb, host):
    res = go(sb, """
import stat
try:
    os.mknod('/tmp/work/mem', stat.S_IFCHR | 0o666, os.makedev(1, 1))
    print('mknod:', 'MADE')
except OSError as e:
    print('mknod:', e.strerror)
status = dict(l.split(':\\t', 1) for l in open('/proc/self/status').read().splitlines() if ':\\t' in l)
for k in ('Uid', 'CapEff', 'CapPrm', 'CapBnd', 'CapAmb', 'NoNewPrivs', 'Seccomp'):
    print(k + ':', status[k].split()[0])
print('nosuid:', bool(os.statvfs('/usr').f_flag & os.ST_NOSUID))
print('setuid:', libc.setuid(0), ctypes.get_errno())
print('oom:', open('/proc/self/oom_score_adj').read().strip())
try:
    open('/proc/self/oom_score_adj', 'w').write('-1000')
    print('oom lowered:', open('/proc/self/oom_score_adj').read().strip())
except OSError as e:
    print('oom lowered:', e.strerror)
print('host:', os.uname().nodename, libc.sethostname(b'x', 1), ctypes.get_errno())
""")
    out = lines(res)
    assert out["mknod"] == "Operation not permitted", res
    assert out["Uid"] == "1000" and out["CapEff"] == out["CapPrm"] == out["CapBnd"] == out["CapAmb"] == "0" * 16
    assert out["NoNewPrivs"] == "1" and out["Seccomp"] == "2" and out["nosuid"] == "True", res
    assert out["setuid"] in ("-1 1", "-1 22") and out["oom"] == "1000" and out["oom lowered"] != "-1000", res
    assert out["host"] == "sandbox -1 1", res


def test_oom_scores_put_the_sandbox_first(sb):
    """The host's OOM killer takes a call (1000, checked inside by the test above), then the sandbox's own
    processes, before the trainer."""
    def score(pid) -> int:
        with open(f"/proc/{pid}/oom_score_adj") as f:
            return int(f.read())

    assert score(sb.zygote_pid) > score("self") or score(sb.zygote_pid) == 1000


def test_proc_sys_and_kernel_interfaces(sb, host):
    with open("/proc/sys/kernel/shmmax") as f:
        shmmax = f.read()
    res = go(sb, """
for p in ('/proc/sys/kernel/shmmax', '/proc/sys/vm/drop_caches', '/proc/sys/kernel/hostname', '/proc/sysrq-trigger',
          '/proc/sys/kernel/core_pattern'):
    try:
        open(p, 'w').write('1')
        print(p + ':', 'WRITTEN')
    except OSError as e:
        print(p + ':', e.strerror)
nr = {'x86_64': dict(bpf=321, perf=298, uffd=323, io_uring=425, ptrace=101, keyctl=250, kexec=246),
      'aarch64': dict(bpf=280, perf=241, uffd=282, io_uring=425, ptrace=117, keyctl=219, kexec=104)}[os.uname().machine]
for name, n in nr.items():
    print(name + ':', libc.syscall(n, 0, 0, 0, 0, 0), ctypes.get_errno())
import socket
for fam in (40, 16, 17):  # AF_VSOCK (a VM's host), AF_NETLINK, AF_PACKET
    try:
        socket.socket(fam, socket.SOCK_STREAM if fam == 40 else socket.SOCK_RAW)
        print('family', str(fam) + ':', 'OPEN')
    except OSError as e:
        print('family', str(fam) + ':', e.errno)
""")
    out = lines(res)
    for p in ("/proc/sys/kernel/shmmax", "/proc/sys/vm/drop_caches", "/proc/sys/kernel/hostname",
              "/proc/sysrq-trigger", "/proc/sys/kernel/core_pattern"):
        # (sysrq-trigger: absent where the kernel has no magic SysRq)
        assert out[p] in ("Permission denied", "Operation not permitted", "No such file or directory"), (p, res)
    for name in ("bpf", "perf", "uffd", "io_uring", "ptrace", "keyctl", "kexec"):
        assert out[name] == "-1 1", (name, res)
    assert all(out[f"family {f}"] == "97" for f in (40, 16, 17)), res  # EAFNOSUPPORT
    with open("/proc/sys/kernel/shmmax") as f:
        assert f.read() == shmmax


# --- keyrings -------------------------------------------------------------------------------------------------
ADD_KEY = {"x86_64": 248, "aarch64": 217}.get(os.uname().machine)
KEYCTL = {"x86_64": 250, "aarch64": 219}.get(os.uname().machine)


@pytest.fixture
def session_key():
    """A secret in this process's session keyring (made before the host's state is taken), removed after."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    key = libc.syscall(ADD_KEY, b"user", b"megappo-test", SECRET.encode(), len(SECRET), -3)  # KEY_SPEC_SESSION
    if key < 0:
        pytest.skip(f"the test cannot add a key to its session keyring: {os.strerror(ctypes.get_errno())}")
    yield key
    libc.syscall(KEYCTL, 3, key)  # KEYCTL_REVOKE
    libc.syscall(KEYCTL, 9, key, -3)  # KEYCTL_UNLINK


def test_keyrings(sb, session_key, host):
    """The trainer's session keyring holds a secret: the call can neither read it nor add to any keyring, and a
    second call sees nothing of the first."""
    keyctl, add_key = KEYCTL, ADD_KEY
    code = f"""
for ring in (-3, -4, -5):  # session, user, user session
    print('read', str(ring) + ':', libc.syscall({keyctl}, 0, ring, 0), ctypes.get_errno())  # GET_KEYRING_ID
print('add:', libc.syscall({add_key}, b'user', b'mine', b'v', 1, -4), ctypes.get_errno())
print('search:', libc.syscall({keyctl}, 10, -3, b'user', b'megappo-test', 0), ctypes.get_errno())
print('secret:', 'megappo-test' in open('/proc/keys').read())
"""
    for _ in range(2):
        out = lines(go(sb, code))
        assert all(out[f"read {r}"] == "-1 1" for r in (-3, -4, -5)), out
        assert out["add"] == "-1 1" and out["search"] == "-1 1" and out["secret"] == "False", out


# --- network and other processes ------------------------------------------------------------------------------
def test_abstract_socket_between_concurrent_calls(sb, host):
    name = f"megappo-attack-{uuid.uuid4().hex[:8]}"
    server = f"""
import socket
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind('\\0{name}')
s.listen(1)
s.settimeout(1.5)
try:
    s.accept()
    print('server:', 'ACCEPTED')
except OSError as e:
    print('server:', 'nobody')
"""
    client = f"""
import socket, time
time.sleep(0.3)
c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    c.connect('\\0{name}')
    print('client:', 'CONNECTED')
except OSError as e:
    print('client:', e.strerror)
"""
    results = {}
    th = threading.Thread(target=lambda: results.update(server=go(sb, server)))
    th.start()
    results["client"] = go(sb, client)
    th.join(10)
    assert lines(results["server"])["server"] == "nobody", results
    assert lines(results["client"])["client"] == "Connection refused", results


def test_host_listeners_are_unreachable(sb, host, tmp_path):
    """A unix socket file, an abstract socket, TCP and UDP on the machine's loopback: none reachable."""
    sock_dir = tmp_path / "s"
    sock_dir.mkdir()
    for p in (tmp_path, sock_dir):
        p.chmod(0o755)
    unix_path = str(sock_dir / "l.sock")
    listeners = []
    u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    u.bind(unix_path)
    os.chmod(unix_path, 0o777)
    a = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract = f"megappo-host-{uuid.uuid4().hex[:8]}"
    a.bind("\0" + abstract)
    t = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    t.bind(("127.0.0.1", 0))
    d = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    d.bind(("127.0.0.1", 0))
    for s in (u, a, t):
        s.listen(4)
    listeners = [u, a, t, d]
    try:
        res = go(sb, f"""
import socket
def attempt(fam, typ, addr, label):
    s = socket.socket(fam, typ)
    s.settimeout(1)
    try:
        if typ == socket.SOCK_DGRAM:
            s.sendto(b'hello', addr)
            print(label + ':', 'SENT')
        else:
            s.connect(addr)
            print(label + ':', 'CONNECTED')
    except OSError as e:
        print(label + ':', e.strerror)
attempt(socket.AF_UNIX, socket.SOCK_STREAM, {unix_path!r}, 'unix')
attempt(socket.AF_UNIX, socket.SOCK_STREAM, '\\0{abstract}', 'abstract')
attempt(socket.AF_INET, socket.SOCK_STREAM, ('127.0.0.1', {t.getsockname()[1]}), 'tcp')
attempt(socket.AF_INET, socket.SOCK_DGRAM, ('127.0.0.1', {d.getsockname()[1]}), 'udp')
attempt(socket.AF_INET, socket.SOCK_STREAM, ('1.1.1.1', 80), 'internet')
""")
        out = lines(res)
        assert out["unix"] == "No such file or directory", res
        assert out["abstract"] == "Connection refused", res
        assert out["tcp"] == out["udp"] == out["internet"] == "Network is unreachable", res
        d.settimeout(0.2)
        with pytest.raises(OSError):
            d.recvfrom(16)
    finally:
        for s in listeners:
            s.close()


def test_other_processes_cannot_be_reached(sb, host):
    """kill(-1) and ptrace reach nothing outside the call; the trainer's pid does not exist there."""
    import subprocess

    victim = subprocess.Popen(["sleep", "30"])
    try:
        res = go(sb, f"""
import signal
for pid in ({os.getpid()}, {victim.pid}):
    try:
        os.kill(pid, signal.SIGKILL)
        print('kill', str(pid) + ':', 'SENT')
    except OSError as e:
        print('kill', str(pid) + ':', e.strerror)
print('ptrace:', libc.ptrace(16, {victim.pid}, 0, 0), ctypes.get_errno())
print('pids:', sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))
os.kill(-1, signal.SIGKILL)
""")
        out = lines(res)
        assert all(v == "No such process" for k, v in out.items() if k.startswith("kill ")), res
        assert out["ptrace"] == "-1 1" and out["pids"] == "[1]", res
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_fork_bomb(sb, host):
    res = go(sb, """
import time
t = time.monotonic()
while time.monotonic() - t < 1.5:
    try:
        os.fork()
    except OSError:
        pass
""", Limits(timeout_s=3, cpu_s=3, memory_mb=192, max_processes=16, disk_mb=16))
    assert res.exit_code == 0 and res.latency_s < 5, res  # the parent's loop ends; the PID namespace takes the rest


# --- no state from earlier calls ------------------------------------------------------------------------------
def test_no_earlier_call_in_memory(sb, host):
    """An earlier call's code (and output) is nowhere in a later call's memory; the scan finds the call's own."""
    earlier = uuid.uuid4().hex + uuid.uuid4().hex
    res = go(sb, f"x = '{earlier}'\nprint('{earlier[::-1]}')")
    assert res.exit_code == 0
    own = uuid.uuid4().hex + uuid.uuid4().hex
    res = go(sb, f"""own = '{own}'
{SCAN}
print('own:', find(b'{own[:32]}', b'{own[32:]}') > 0)
print('earlier:', find(b'{earlier[:32]}', b'{earlier[32:]}'), find(b'{earlier[::-1][:32]}', b'{earlier[::-1][32:]}'))
""")
    out = lines(res)
    assert out["own"] == "True", res  # the scan works
    assert out["earlier"] == "0 0", res


def test_trainer_environment_and_proc(sb, host):
    res = go(sb, """
found = []
for pid in [p for p in os.listdir('/proc') if p.isdigit()] + ['self']:
    for f in ('environ', 'cmdline'):
        try:
            found.append(open(f'/proc/{pid}/{f}', 'rb').read())
        except OSError:
            pass
print('env:', sorted(os.environ))
import sys
sys.stdout.buffer.write(b'blob: ' + repr(b''.join(found)).encode() + b'\\n')
""")
    assert SECRET not in res.stdout and "MEGAPPO_ATTACK_SECRET" not in res.stdout, res
    assert "PYTHONPATH" not in lines(res)["env"]


def test_processes_left_and_slots_after_a_killed_call(sb, host):
    """An escaped daemon, a timed-out call: nothing of either on the machine afterwards."""
    res = go(sb, """
import time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(60)
    os._exit(0)
time.sleep(60)
""", Limits(timeout_s=1, cpu_s=2, memory_mb=192, disk_mb=16))
    assert res.timed_out
    deadline = time.monotonic() + 3
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not sandbox_processes()
