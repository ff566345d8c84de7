"""The sandboxed Python tool against hostile code: each program gets a clear answer, the run goes on, nothing outside
the sandbox changes, and no process is left (checked in the process table). Real processes, small limits."""
from __future__ import annotations

import os
import shutil
import stat
import sys
import threading
import time
import uuid

import psutil
import pytest

from megappo.multi_turn.python_tool import PythonTool
from megappo.sandbox import UID_SLICE, UID_SPACE, Limits, Sandbox, SandboxUnavailable, truncate

from _sandbox_host import busy_children, sandbox_processes

pytestmark = [pytest.mark.timeout(120), pytest.mark.alone]  # its host checks see the whole machine

SCHEMA = {"type": "function", "function": {"name": "code_interpreter", "parameters": {
    "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}
CONFIG = {"timeout_s": 3, "cpu_s": 1, "memory_mb": 512, "max_processes": 16, "max_file_mb": 8, "disk_mb": 32,
          "max_output_chars": 2000, "max_output_bytes": 1 << 20}


def assert_nothing_left(tool: PythonTool) -> None:
    """No sandbox-uid process, and the zygote has no child but its spare (its supervisors answered and exited)."""
    deadline = time.monotonic() + 3.0
    while True:
        left = sandbox_processes()
        children = busy_children(tool.sandbox.zygote_pid)
        if not left and not children:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"left running: {[(p.pid, p.cmdline()) for p in left]}, zygote's: {children}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def tool():
    t = PythonTool(CONFIG, SCHEMA)
    try:
        t.start()
    except SandboxUnavailable as e:
        pytest.skip(f"this machine cannot isolate the code: {e}")
    yield t
    zygote = t.sandbox.zygote_pid
    t.close()
    assert not psutil.pid_exists(zygote) or psutil.Process(zygote).status() == psutil.STATUS_ZOMBIE
    assert not sandbox_processes()


@pytest.fixture
def outside(tmp_path):
    """A file outside the sandbox in a world-writable place (so only the read-only mount stops the code), and a
    directory in the repository; both must be unchanged after the call."""
    d = f"/var/tmp/megappo-sbx-test-{uuid.uuid4().hex[:8]}"
    os.makedirs(d)
    os.chmod(d, 0o777)
    marker = os.path.join(d, "marker.txt")
    with open(marker, "w") as f:
        f.write("untouched")
    os.chmod(marker, 0o666)
    yield marker
    shutil.rmtree(d, ignore_errors=True)


def run(tool: PythonTool, code: str):
    t0 = time.monotonic()
    res = tool.execute("traj-0", {"code": code})
    return res, time.monotonic() - t0


def test_normal_code_runs_and_is_fast(tool):
    res, took = run(tool, "import math\nprint(math.factorial(10))\nprint(sum(range(5)))")
    assert res.text == "3628800\n10\n"
    assert res.metrics["error"] == 0 and res.metrics["timeout"] == 0 and res.metrics["exit_code"] == 0
    assert took < 2.0, took  # ~10-40 ms on an idle machine; generous for a loaded 2-core CI box
    res, _ = run(tool, "import numpy as np\nprint(int(np.arange(10).sum()))")  # the venv's packages are there
    assert res.text == "45\n", res.text
    assert_nothing_left(tool)


def test_exception_is_an_answer(tool):
    res, _ = run(tool, "print('before')\n1/0")
    assert res.text.startswith("before\nstderr:\nTraceback") and "ZeroDivisionError" in res.text
    assert "_sandbox" not in res.text and "runner.py" not in res.text  # the traceback starts at the code
    assert res.text.rstrip().endswith("Exit code 1.") and res.metrics["error"] == 1


def test_bad_arguments(tool):
    res = tool.execute("traj-0", {"cod": "print(1)"})
    assert 'needs a string argument "code"' in res.text and res.metrics["error"] == 1
    res = tool.execute("traj-0", {"code": 3})
    assert 'needs a string argument "code"' in res.text


def test_socket_has_no_network(tool):
    code = ("import socket\n"
            "for host in ('1.1.1.1', '127.0.0.1'):\n"
            "    try:\n"
            "        socket.create_connection((host, 80), timeout=1)\n"
            "        print(host, 'CONNECTED')\n"
            "    except OSError as e:\n"
            "        print(host, 'refused:', e)\n"
            "print(sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]))\n")
    res, took = run(tool, code)
    assert "CONNECTED" not in res.text, res.text
    assert "1.1.1.1 refused: [Errno 101] Network is unreachable" in res.text, res.text
    assert "['lo']" in res.text  # the namespace's only interface, and it is down
    assert took < 2.0
    assert_nothing_left(tool)


def test_writes_outside_its_directory_change_nothing(tool, outside):
    repo_file = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), f"sbx-{os.getpid()}.txt")
    targets = [outside, os.path.join(os.path.dirname(outside), "new.txt"), "/etc/megappo-sbx-test", repo_file,
               "/dev/shm/../megappo", "/root/x"]
    code = (f"import os\nfor path in {targets!r}:\n"
            "    try:\n"
            "        with open(path, 'w') as f: f.write('CHANGED')\n"
            "        print(path, 'WRITTEN')\n"
            "    except OSError as e:\n"
            "        print(path, 'refused:', e.strerror)\n"
            f"for act in (lambda: os.remove({outside!r}), lambda: os.chmod({outside!r}, 0)):\n"
            "    try:\n"
            "        act(); print('CHANGED')\n"
            "    except OSError as e:\n"
            "        print('refused:', e.strerror)\n"
            "open('mine.txt', 'w').write('ok'); print('own dir', os.getcwd(), os.listdir('.'))\n")
    res, _ = run(tool, code)
    assert "WRITTEN" not in res.text and "CHANGED" not in res.text, res.text
    assert "Read-only file system" in res.text
    assert "own dir /tmp/work ['mine.txt']" in res.text
    with open(outside) as f:
        assert f.read() == "untouched"
    assert stat.S_IMODE(os.stat(outside).st_mode) == 0o666
    assert not os.path.exists(targets[1]) and not os.path.exists("/etc/megappo-sbx-test")
    assert not os.path.exists(repo_file)
    assert_nothing_left(tool)


def test_each_call_gets_a_fresh_directory(tool):
    before = set(os.listdir("/tmp"))
    res, _ = run(tool, "import os\nopen('a.txt', 'w').write('x' * 100)\nos.mkdir('d')\nprint(os.listdir('.'))")
    assert "a.txt" in res.text
    res, _ = run(tool, "import os, tempfile\nprint(os.listdir('.'), os.environ['HOME'], tempfile.gettempdir())")
    assert res.text == "[] /tmp/work /tmp/work\n", res.text
    assert set(os.listdir("/tmp")) - before == set()  # nothing of it on the machine's /tmp


def test_file_size_and_disk_limits(tool):
    res, _ = run(tool, "f = open('big', 'wb')\nf.write(b'x' * (20 << 20))")  # max_file_mb 8
    assert "File too large" in res.text, res.text


def test_fork_bomb_of_a_hundred(tool):
    code = ("import os, time\nn = 0\n"
            "try:\n"
            "    for _ in range(100):\n"
            "        if os.fork() == 0:\n"
            "            time.sleep(60)\n"
            "            os._exit(0)\n"
            "        n += 1\n"
            "finally:\n"
            "    print('forked', n, flush=True)\n")
    res, took = run(tool, code)
    assert "forked 15" in res.text, res.text  # max_processes 16, the code's own process included
    assert "BlockingIOError" in res.text and "Resource temporarily unavailable" in res.text
    assert took < 3.0  # the call ends with its main process (before the timeout); its sleeping children are killed
    assert_nothing_left(tool)


def test_allocating_10_gb(tool):
    res, took = run(tool, "x = bytearray(10 * 1024 ** 3)\nprint('ALLOCATED')")
    assert "ALLOCATED" not in res.text
    assert "MemoryError" in res.text and "out of memory (limit 512 MB)" in res.text, res.text
    assert took < 2.0
    assert_nothing_left(tool)


def test_loop_forever(tool):
    res, took = run(tool, "print('start', flush=True)\nwhile True:\n    pass")
    # cpu_s 1 < timeout_s 3: the CPU limit, unless a loaded machine gave it less than a CPU second in 3 s
    assert res.text.startswith("start\n"), res.text
    assert ("CPU time limit exceeded (1 s)" in res.text) or ("timed out after 3 s" in res.text), res.text
    assert res.metrics["error"] == 1 and took < 5.0
    assert_nothing_left(tool)


def test_sleep_forever(tool):
    res, took = run(tool, "import time\nprint('zz', flush=True)\ntime.sleep(10 ** 6)")
    assert res.text == "zz\nError: timed out after 3 s (the wall-time limit); the program was killed.", res.text
    assert res.metrics["timeout"] == 1
    assert 3.0 <= took < 5.0
    assert_nothing_left(tool)


def test_print_100_mb(tool):
    res, took = run(tool, "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * (1 << 20))\nprint('END')")
    assert "output limit exceeded" in res.text and "the program was killed" in res.text, res.text[-300:]
    assert len(res.text) < CONFIG["max_output_chars"] + 300
    assert res.metrics["output_truncated"] == 1
    assert took < 3.0  # stopped at the 1 MB cap, not at the timeout
    rss = psutil.Process().memory_info().rss
    assert rss < 2 << 30  # (the caller never held the 100 MB)
    assert_nothing_left(tool)


def test_escaped_and_hidden_processes_are_swept(tool):
    """A grandchild that leaves the session (setsid) and makes itself non-dumpable still goes with the call."""
    code = ("import os, time, ctypes\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    if os.fork() == 0:\n"
            "        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: /proc/<pid> owned by root\n"
            "        os.close(1); os.close(2)\n"
            "        time.sleep(60)\n"
            "    os._exit(0)\n"
            "time.sleep(0.2)\nprint('parent done')\n")
    res, _ = run(tool, code)
    assert res.text == "parent done\n", res.text
    assert_nothing_left(tool)


def test_too_long_code_and_a_killed_zygote(tool):
    res, _ = run(tool, "x = 1\n" * 30000)
    assert res.text.startswith("Error: the sandbox failed to run the code (the code is 180000 bytes; the limit is")
    assert res.metrics["sandbox_error"] == 1
    import signal

    old = tool.sandbox.zygote_pid
    os.kill(old, signal.SIGKILL)  # killed from outside: the next call starts a fresh one
    psutil.Process(old).wait(timeout=10) if psutil.pid_exists(old) else None
    res, _ = run(tool, "print('again')")
    assert res.text == "again\n" and tool.sandbox.zygote_pid != old


def test_the_run_goes_on_after_all_that(tool):
    res, _ = run(tool, "print('still here')")
    assert res.text == "still here\n"


def test_no_view_of_the_machine(monkeypatch):
    """Its own /proc (its PID namespace's processes only), none of the trainer's environment, and of the machine's
    directories only the interpreter's and the system's (no /home, /run, /sys; /root holds the interpreter's prefix
    alone when it lives there)."""
    monkeypatch.setenv("MEGAPPO_TEST_SECRET", "hunter2")
    code = ("import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()), os.getpid())\n"
            "print('hunter2' in repr(dict(os.environ)))\n"
            "try:\n    print('hunter2' in open('/proc/self/environ').read())\n"
            "except OSError as e:\n    print('environ unreadable', e.strerror)\n"
            "print([(p, sorted(os.listdir(p)) if os.path.isdir(p) else None) for p in ('/root', '/home', '/run', "
            "'/sys')])\n")
    with Sandbox(Limits(timeout_s=10)) as sb:
        res = sb.run(code)
    lines = res.stdout.splitlines()
    assert lines[0] == "[1] 1" and lines[1] == "False", res
    assert lines[2] in ("False", "environ unreadable Permission denied"), res
    assert "hunter2" not in res.stdout
    for path, names in eval(lines[3]):
        # absent, or only what leads to the interpreter (the venv's python may live under /root)
        assert names is None or all(os.path.realpath(sys.executable).startswith(os.path.join(path, n)) or
                                    sys.prefix.startswith(os.path.join(path, n)) for n in names), (path, names)


def test_two_sandboxes_never_share_a_uid(tool):
    """Each zygote's calls take uids from a slice of its own (the sweep kills every process of a call's uid); seen
    from the machine, since inside its user namespace the code is uid 1000."""
    import threading

    def uids_of(call) -> list[int]:
        seen: set[int] = set()
        th = threading.Thread(target=call)
        th.start()
        while th.is_alive():
            seen.update(p.info["uids"].real for p in sandbox_processes())
            time.sleep(0.01)
        return sorted(seen)

    code = "import os, time\nprint(os.getuid())\ntime.sleep(0.3)"
    with Sandbox(Limits(timeout_s=5)) as other:
        for sb_pid, call in ((tool.sandbox.zygote_pid, lambda: run(tool, code)),
                             (other.zygote_pid, lambda: other.run(code))):
            uids = [u for _ in range(3) for u in uids_of(call)]
            base = UID_SPACE + (sb_pid % (1 << 22)) * UID_SLICE
            assert len(uids) == 3 and all(base <= u < base + UID_SLICE for u in uids), (sb_pid, uids)
            assert len(set(uids)) == 3  # and a fresh one per call
    assert run(tool, code)[0].text == "1000\n"


def test_truncate_sides_match_verl():
    text = "abcdefghij"
    assert truncate(text, 4, "left") == "(truncated)...ghij"
    assert truncate(text, 4, "right") == "abcd...(truncated)"
    assert truncate(text, 4, "middle") == "ab...(truncated)...ij"
    assert truncate(text, 10, "middle") == text and truncate(text, 0, "left") == text
    with pytest.raises(ValueError, match="left, right or middle"):
        truncate(text, 4, "top")


def test_long_output_is_cut_in_the_middle(tool):
    res, _ = run(tool, "for i in range(5000):\n    print(i)")
    assert res.text.startswith("0\n1\n2\n") and res.text.endswith("4998\n4999\n")
    assert "...(truncated)..." in res.text and len(res.text) <= CONFIG["max_output_chars"] + 20


def test_close_kills_calls_in_flight():
    import threading

    t = PythonTool({"timeout_s": 30}, SCHEMA).start()
    out = []
    th = threading.Thread(target=lambda: out.append(t.execute("x", {"code": "import time\ntime.sleep(600)"})))
    th.start()
    deadline = time.monotonic() + 10
    while not sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_processes(), "the call never started"
    zygote = t.sandbox.zygote_pid
    t.close()
    th.join(timeout=15)
    assert not th.is_alive() and out and "failed" in out[0].text, out
    assert not psutil.pid_exists(zygote) or psutil.Process(zygote).status() == psutil.STATUS_ZOMBIE
    assert not sandbox_processes()


def _wrapper(tmp_path, name: str, line: str) -> str:
    if os.geteuid() != 0 or not shutil.which("setpriv") or not shutil.which("unshare"):
        pytest.skip("needs root, setpriv and unshare to play another machine")
    wrapper = tmp_path / name
    wrapper.write_text(f"#!/bin/sh\n{line}\n")
    wrapper.chmod(0o755)
    return str(wrapper)


def test_refuses_where_it_cannot_isolate(tmp_path):
    # a machine where no namespace can be made: a user namespace whose uid is unmapped may create none
    python = _wrapper(tmp_path, "python-no-namespaces", f'exec unshare -U {sys.executable} "$@"')
    with pytest.raises(SandboxUnavailable) as e:
        Sandbox(Limits(timeout_s=2), python=python).start()
    msg = str(e.value)
    assert "refusing to start the Python sandbox" in msg and "allow_network_unsandboxed" in msg
    assert "allow_filesystem_unsandboxed" in msg and "unshare" in msg and "user namespaces" in msg, msg
    # accepted: limits and a directory of its own under /tmp only; each call's removed before its answer comes,
    # the rest at the close, a call still running then included
    before = _sandbox_dirs()
    with Sandbox(Limits(timeout_s=2, max_processes=64), python=python, allow_network_unsandboxed=True,
                 allow_filesystem_unsandboxed=True) as sb:
        assert sb.state["net"] is False and sb.state["fs"] is False
        res = sb.run("import os\nprint(os.getcwd())\nprint(sum(range(4)))", Limits(timeout_s=10, max_processes=64))
        assert res.exit_code == 0 and res.stdout.endswith("\n6\n"), res
        assert not os.path.exists(res.stdout.splitlines()[0])
        res = sb.run("import time\ntime.sleep(100)")
        assert res.timed_out
        (mine,) = _sandbox_dirs() - before
        busy = threading.Thread(target=sb.run, args=("import time\ntime.sleep(100)", Limits(timeout_s=30)))
        busy.start()
        deadline = time.monotonic() + 15
        while not os.listdir(os.path.join("/tmp", mine)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert os.listdir(os.path.join("/tmp", mine)), "the call in flight has a directory"
    busy.join(timeout=30)
    assert not busy.is_alive()
    assert not _sandbox_dirs() - before  # the close waits for the zygote, which removed them


def _sandbox_dirs() -> set[str]:
    return {n for n in os.listdir("/tmp") if n.startswith("megappo-sandbox-")}


def test_unprivileged_user_namespace_mode(tmp_path, outside):
    """Not root: the namespaces are made in a user namespace; each call's runner enters a nested one (no
    capability over the mounts) and a PID namespace (emptied by the kernel when it ends); RLIMIT_NPROC counts the
    call's processes only, concurrent calls included."""
    import threading

    if not os.path.exists("/usr/bin/python3"):
        pytest.skip("needs the system's /usr/bin/python3 (readable by nobody)")
    python = _wrapper(tmp_path, "python-as-nobody",
                      'exec setpriv --reuid=65534 --regid=65534 --clear-groups /usr/bin/python3 "$@"')
    try:
        sb = Sandbox(Limits(timeout_s=2, cpu_s=2, memory_mb=256, max_processes=8), python=python).start()
    except SandboxUnavailable as e:
        pytest.skip(f"no unprivileged user namespaces here: {e}")
    try:
        assert sb.state["mode"] == "userns" and sb.state["net"] and sb.state["fs"], sb.state
        res = sb.run(f"open({outside!r}, 'w').write('CHANGED')")
        assert "No such file or directory" in res.stderr  # not in its root at all
        res = sb.run("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                     "print(libc.unshare(0x00020000), libc.mount(None, b'/', None, 32 | 4096, None))\n"
                     "open('/usr/x', 'w')")  # no mount namespace of its own: the read-only mounts stay
        assert res.stdout == "-1 -1\n" and "Read-only file system" in res.stderr, res
        # no memory cgroup for an unprivileged user here: the bound is shmmax and no memfd (and RLIMIT_AS)
        assert sb.state["memory"]["cgroup"] is None and "memfd_create refused" in sb.state["memory"]["bound"]
        res = sb.run("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                     "print(libc.shmget(0, 512 << 20, 0o1600), ctypes.get_errno())\nos.memfd_create('x')")
        assert res.stdout == "-1 22\n" and "Operation not permitted" in res.stderr, res
        res = sb.run("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)")
        assert "Network is unreachable" in res.stderr
        fork = ("import os, time\nn = 0\ntry:\n    for _ in range(100):\n        if os.fork() == 0:\n"
                "            os.setsid()\n            time.sleep(60)\n            os._exit(0)\n        n += 1\n"
                "finally:\n    print('forked', n)\n")
        out = []
        threads = [threading.Thread(target=lambda: out.append(sb.run(fork).stdout)) for _ in range(3)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=30)
        assert out == ["forked 7\n"] * 3, out
        res = sb.run("import time\ntime.sleep(100)")
        assert res.timed_out
        with open(outside) as f:
            assert f.read() == "untouched"
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            left = busy_children(sb.zygote_pid)
            if not left:
                break
            time.sleep(0.05)
        assert not left, left
    finally:
        sb.close()


def test_venv_under_tmp(tmp_path):
    """An interpreter whose venv lives under /tmp: each call's own /tmp still holds it (bound back in), and its
    packages import."""
    import subprocess

    if not str(tmp_path).startswith("/tmp/"):
        pytest.skip(f"pytest's tmp_path {tmp_path} is not under /tmp")
    env_dir = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    site = subprocess.run([str(env_dir / "bin" / "python"), "-c",
                           "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "megappo_venv_probe.py"), "w") as f:
        f.write("VALUE = 42\n")
    for p in [tmp_path, *[q for q in env_dir.rglob("*") if q.is_dir()], env_dir]:
        os.chmod(p, 0o755)
    with Sandbox(Limits(timeout_s=10), python=str(env_dir / "bin" / "python")) as sb:
        res = sb.run("import sys, megappo_venv_probe\nprint(megappo_venv_probe.VALUE, sys.prefix)")
    assert res.stdout == f"42 {env_dir}\n", res


def test_refuses_without_a_seccomp_filter():
    """No filter (another machine, or no CONFIG_SECCOMP_FILTER): refused unless allow_syscalls_unfiltered."""
    from megappo.sandbox._zygote import __file__ as pkg

    state = {"net": True, "fs": True, "filter": False}
    assert Sandbox()._problems(state) == ["no seccomp filter, so the code could make namespaces, mounts and keyrings "
                                          "of its own (set allow_syscalls_unfiltered: true to accept that)"]
    assert Sandbox(allow_syscalls_unfiltered=True)._problems(state) == []
    import importlib.util

    spec = importlib.util.spec_from_file_location("_megappo_sandbox_kernel",
                                                  os.path.join(os.path.dirname(pkg), "kernel.py"))
    kernel = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = kernel
    spec.loader.exec_module(kernel)
    seccomp = kernel.load("seccomp")
    assert not seccomp.supported("riscv64") and seccomp.supported("aarch64") and seccomp.supported("x86_64")
    for machine in ("x86_64", "aarch64"):
        prog = seccomp.program(block_memfd=True, machine=machine)
        assert prog[1][3] == seccomp.AUDIT_ARCH[machine] and prog[2][3] == seccomp.RET_KILL_PROCESS
        assert all(0 <= jt < 256 and 0 <= jf < 256 for _, jt, jf, _ in prog) and len(prog) < 4096
        denied = {k for c, _, _, k in prog if c == seccomp.JEQ}
        assert {seccomp.SYSCALLS[machine][n] for n in ("unshare", "mount", "keyctl", "memfd_create")} <= denied
        assert seccomp.SYSCALLS[machine]["memfd_create"] not in \
            {k for c, _, _, k in seccomp.program(block_memfd=False, machine=machine) if c == seccomp.JEQ}


def test_verl_sandbox_fusion_config_ports():
    """verl's ReTool tool config (SandboxFusion's keys) works as it is."""
    t = PythonTool({"default_timeout": 30, "memory_limit_mb": 1024, "num_workers": 128, "rate_limit": 128,
                    "enable_global_rate_limit": True, "sandbox_fusion_url": "http://x", "default_language": "python",
                    "type": "native"}, SCHEMA)
    assert t.limits.timeout_s == 30 and t.limits.memory_mb == 1024
    with pytest.raises(ValueError, match="Python only"):
        PythonTool({"default_language": "cpp"}, SCHEMA)
    with pytest.raises(ValueError, match="both timeout_s and verl's default_timeout"):
        PythonTool({"default_timeout": 3, "timeout_s": 3}, SCHEMA)


def test_unknown_config_key():
    with pytest.raises(ValueError, match="unknown keys \\['timeout'\\]"):
        PythonTool({"timeout": 3}, SCHEMA)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_the_sandbox_dies_with_its_trainer(tmp_path):
    """The trainer SIGKILLed mid-call: the zygote sees its parent gone and kills the call and its processes."""
    import signal
    import subprocess

    script = tmp_path / "trainer.py"
    script.write_text(
        "import sys, threading\n"
        "from megappo.multi_turn.python_tool import PythonTool\n"
        f"t = PythonTool({{'timeout_s': 60}}, {SCHEMA!r}).start()\n"
        "print(t.sandbox.zygote_pid, flush=True)\n"
        "t.execute('x', {'code': 'import os, time\\nos.fork()\\ntime.sleep(600)'})\n")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env, text=True)
    try:
        zygote = int(proc.stdout.readline())
        deadline = time.monotonic() + 20
        while len(sandbox_processes()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(sandbox_processes()) == 2, "the call and its child never ran"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while (sandbox_processes() or psutil.pid_exists(zygote)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not sandbox_processes() and not psutil.pid_exists(zygote)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
