"""A started SGLang server is always stopped and always ours (real servers on CPU, real signals, real `ps`).

- Ctrl-C during `start()`, SIGTERM or SIGKILL of the process that started it: no process of it is left, children
  (scheduler, detokenizer) included; they are found by the test's unique port and the server's process group.
- A job-wide signal (Slurm's preemption SIGTERM, SIGUSR1, SIGINT: to every process of the job) leaves the server,
  its watchdog and its children running and serving; only the parent stops them, and `stop()` does so in seconds.
- A port taken after the free-port check (another HTTP server that answers /health) is left for a new one when the
  port was chosen automatically; a taken port set by the caller is an error naming it.
- The server's API key is required (a wrong one gets HTTP 401), and requests to it ignore a proxy in the
  environment. A clean stop deletes the log; a failed start keeps it and shows its tail.
- The weight group's rendezvous listens on the master address only and times out in seconds; a dead peer fails a
  broadcast at once.
"""
from __future__ import annotations

import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from megappo.rollout import SamplingParams
from megappo.rollout.sglang.engine import SGLangEngine
from megappo.rollout.serving.http_client import http_json
from megappo.rollout.serving.process import free_port
from megappo.rollout.sglang.server import SGLangServer

SGLANG = [pytest.mark.e2e, pytest.mark.sglang]
GREEDY = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)

PARENT = """
import signal, sys, time
# Ctrl-C raises KeyboardInterrupt even when this test runs with SIGINT ignored (inherited by a background job of a
# non-interactive shell, e.g. `.ci/run &`), in which case Python would install no handler
signal.signal(signal.SIGINT, signal.default_int_handler)
from megappo.rollout.sglang.server import SGLangServer
server = SGLangServer(sys.argv[1], python=sys.argv[2], port=int(sys.argv[3]))
print(server.log.name, flush=True)
server.start()
print("started", flush=True)
time.sleep(600)
"""


# -- processes, as `ps` shows them ---------------------------------------------------------------------------------
def _ps() -> list[tuple[int, int, str, str]]:
    """(pid, pgid, state, args) of every process."""
    # -ww: without it ps cuts lines at $COLUMNS (pytest sets it), and the port is at the end of the command
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,pgid=,stat=,args="], capture_output=True, text=True,
                         check=True).stdout
    rows = []
    for line in out.splitlines():
        pid, pgid, stat, *args = line.split(None, 3)
        rows.append((int(pid), int(pgid), stat, args[0] if args else ""))
    return rows


def _left(port: int, groups: set[int]) -> list[str]:
    """Live processes of the server on `port`: its command lines name the port; its children are in its group."""
    marker = f"--port {port}"
    return [f"{pid} {stat} {args[:160]}" for pid, pgid, stat, args in _ps()
            if not stat.startswith("Z") and pid != os.getpid() and (marker in args or pgid in groups)]


def _server_groups(port: int) -> set[int]:
    return {pgid for _, pgid, _, args in _ps() if f"--port {port}" in args and "sglang.launch_server" in args
            and "reaper.py" not in args}


def _wait_for(cond, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _kill_leftovers(port: int, groups: set[int]) -> None:
    """The test's own processes only: those naming its port, and the server's process groups."""
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid, _, _, args in _ps():
        if f"--port {port}" in args and pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# -- the parent dies -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sig, when", [(signal.SIGINT, "starting"), (signal.SIGTERM, "starting"),
                                       (signal.SIGKILL, "started")], ids=["ctrl-c", "sigterm", "sigkill"])
@pytest.mark.timeout(300)
@pytest.mark.e2e
@pytest.mark.sglang
def test_the_server_dies_with_its_parent(sglang_python, hf_model_dir, sig, when):
    """The parent is a python process that starts a server. Ctrl-C and SIGTERM come while `start()` waits (once the
    server has its scheduler and detokenizer children), SIGKILL once it is up."""
    port = free_port()
    parent = subprocess.Popen([sys.executable, "-c", PARENT, hf_model_dir("qwen2"), sglang_python, str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    groups: set[int] = set()
    log = parent.stdout.readline().strip()
    try:
        groups = _wait_for(lambda: _server_groups(port), 60, "the server process")
        # the children: a group of the server, its resource tracker, scheduler and detokenizer
        _wait_for(lambda: len(_left(port, groups)) >= 5, 120, "the server's children")
        if when == "started":
            assert _wait_for(lambda: parent.stdout.readline().strip(), 240, "start()") == "started"
        before = _left(port, groups)
        t0 = time.time()
        parent.send_signal(sig)
        parent.wait(timeout=60)
        _wait_for(lambda: not _left(port, groups), 45, f"no process left (still: {_left(port, groups)})")
        print(f"\n{len(before)} processes gone {time.time() - t0:.1f} s after {sig.name} of the parent")
        if sig == signal.SIGINT:
            err = parent.stderr.read()
            assert "KeyboardInterrupt" in err and parent.returncode != 0, err[-2000:]
            assert os.path.exists(log)  # an interrupted start is a failed one: its log is kept
    finally:
        parent.kill()
        parent.wait()
        _kill_leftovers(port, groups)
        if log and os.path.exists(log):
            os.unlink(log)


# -- one server, started on a port that someone else takes -----------------------------------------------------------
class _Impostor(http.server.BaseHTTPRequestHandler):
    """Answers 200 to everything, with or without a key: what a foreign server on our port looks like."""
    hits = 0

    def _ok(self):
        type(self).hits += 1
        body = b"{}"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _ok

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def raced(sglang_python, hf_model_dir):
    """A server whose automatically chosen port is taken by an impostor right after the free-port check (as soon
    as its watchdog runs): start() must notice and move to another port. Shared by the tests below."""
    server = SGLangServer(hf_model_dir("qwen2"), python=sglang_python)
    first = server.port
    impostor: dict = {}

    def take_port():
        _wait_for(lambda: any(f"--port {first}" in a for *_, a in _ps()), 60, "the launch")
        impostor["http"] = http.server.HTTPServer(("127.0.0.1", first), _Impostor)
        impostor["http"].serve_forever(poll_interval=0.1)

    thread = threading.Thread(target=take_port, daemon=True)
    thread.start()
    try:
        seconds = server.start(timeout=500)
        yield server, first, seconds
    finally:
        server.stop()
        if "http" in impostor:
            impostor["http"].shutdown()
            impostor["http"].server_close()
        _kill_leftovers(first, set())
        _kill_leftovers(server.port, set())


@pytest.mark.timeout(600)
@pytest.mark.e2e
@pytest.mark.sglang
def test_a_taken_automatic_port_is_replaced_and_the_server_is_ours(raced):
    server, first, seconds = raced
    print(f"\nstarted on port {server.port} after port {first} was taken: {seconds:.1f} s")
    assert server.port != first and server.url.endswith(f":{server.port}")
    assert _Impostor.hits > 0  # the impostor did answer on the first port
    assert not _left(first, set())  # the first attempt's server is gone
    assert http_json(server.url + "/model_info")["model_path"] == server.cmd[server.cmd.index("--model-path") + 1]


@pytest.mark.timeout(120)
@pytest.mark.e2e
@pytest.mark.sglang
def test_a_wrong_api_key_is_refused_and_ours_works(raced):
    server, _, _ = raced
    with pytest.raises(RuntimeError, match="HTTP 401"):
        http_json(server.url + "/model_info", api_key="wrong")
    bare = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with pytest.raises(urllib.error.HTTPError) as no_key:
        bare.open(urllib.request.Request(server.url + "/generate", data=b"{}"), timeout=10)
    assert no_key.value.code == 401
    out = SGLangEngine(server.url, api_key=server.api_key).generate([[5, 6, 7]], GREEDY)
    assert len(out[0][0].output_ids) == 4
    assert not any(server.api_key in args for *_, args in _ps())  # the key is not on a command line


@pytest.mark.timeout(120)
@pytest.mark.e2e
@pytest.mark.sglang
def test_requests_to_the_server_ignore_a_proxy(raced, monkeypatch):
    server, _, _ = raced
    dead = f"http://127.0.0.1:{free_port()}"
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY"):
        monkeypatch.setenv(name, dead)
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(urllib.error.URLError):  # plain urllib goes to the (dead) proxy
        urllib.request.build_opener().open(server.url + "/health", timeout=10)
    assert http_json(server.url + "/model_info")["model_type"] == "qwen2"
    assert len(SGLangEngine(server.url).generate([[5, 6, 7]], GREEDY)[0][0].output_ids) == 4


def _signal_state(pid: int) -> tuple[int, int]:
    """The (blocked, ignored) signal masks of a process, from /proc."""
    fields = dict(line.split(":\t", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":\t" in line)
    return int(fields["SigBlk"], 16), int(fields["SigIgn"], 16)


@pytest.mark.timeout(120)
@pytest.mark.e2e
@pytest.mark.sglang
def test_a_job_wide_signal_leaves_the_server_serving(raced):
    """What Slurm does on preemption: the signal to every process of the job, the watchdog and the server's own
    children included. The parent decides when its server stops (the test before it: a clean stop)."""
    server, _, _ = raced
    groups = _server_groups(server.port)
    tree = [(pid, args) for pid, pgid, stat, args in _ps()
            if not stat.startswith("Z") and (pgid in groups or pid == server.proc.pid)]
    assert len(tree) >= 4, tree  # the watchdog, the server, its scheduler and detokenizer (and resource tracker)
    wanted = sum(1 << (int(s) - 1) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1))
    for pid, args in tree:
        blocked, ignored = _signal_state(pid)
        assert blocked & wanted == wanted or ignored & wanted == wanted, (pid, args, hex(blocked), hex(ignored))
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGTERM):
        for pid, _ in tree:
            os.kill(pid, sig)
        time.sleep(0.5)
    time.sleep(2)
    alive = {pid for pid, _, stat, _ in _ps() if not stat.startswith("Z")}
    assert [(pid, args[:120]) for pid, args in tree if pid not in alive] == [], "died of a job-wide signal"
    assert server.proc.poll() is None
    assert len(SGLangEngine(server.url, api_key=server.api_key).generate([[5, 6, 7]], GREEDY)[0][0].output_ids) == 4


@pytest.mark.timeout(120)
@pytest.mark.e2e
@pytest.mark.sglang
def test_a_clean_stop_deletes_the_log_and_leaves_no_process(raced):
    server, _, _ = raced
    groups = _server_groups(server.port)
    assert groups and _left(server.port, groups)
    t0 = time.time()
    server.stop()
    seconds = time.time() - t0
    print(f"\nstop: {seconds:.1f} s")
    assert not _left(server.port, groups)
    assert seconds < 10, "the server ignores SIGTERM: stop() must not wait out a grace period for it"
    assert not os.path.exists(server.log.name)


# -- failures that need no healthy server ----------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.e2e
@pytest.mark.sglang
def test_a_taken_port_set_by_the_caller_is_an_error_naming_it(sglang_python, hf_model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = SGLangServer(hf_model_dir("qwen2"), python=sglang_python, port=port)
        with pytest.raises(RuntimeError, match=f"port {port} on 127.0.0.1 is taken"):
            server.start(timeout=60)
    assert not _left(port, set())
    os.unlink(server.log.name)


@pytest.mark.timeout(180)
@pytest.mark.e2e
@pytest.mark.sglang
def test_a_failed_start_keeps_the_log_and_shows_its_tail(sglang_python, hf_model_dir):
    server = SGLangServer(hf_model_dir("qwen2"), python=sglang_python, extra_args=["--no-such-flag"])
    try:
        with pytest.raises(RuntimeError) as failed:
            server.start(timeout=150)
        message = str(failed.value)
        assert "unrecognized arguments: --no-such-flag" in message and server.log.name in message
        assert "megappo-reaper: server exited with code 2" in message
        with open(server.log.name) as f:
            assert "unrecognized arguments" in f.read()
        assert not _left(server.port, set())
    finally:
        _kill_leftovers(server.port, set())
        if os.path.exists(server.log.name):
            os.unlink(server.log.name)


# -- the weight group's rendezvous (torch only) ----------------------------------------------------------------------
PEER = """
import sys, time, torch, torch.distributed as dist
from megappo.rollout.serving.weight_group import init_weight_group
pg = init_weight_group("127.0.0.1", int(sys.argv[1]), rank=1, world_size=2, group_name="g", timeout=5)
t = torch.zeros(3)
dist.broadcast(t, src=0, group=pg)
print("got", t.tolist(), flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(120)
@pytest.mark.e2e
def test_the_weight_group_listens_on_the_master_address_and_fails_fast():
    import torch
    import torch.distributed as dist

    from megappo.rollout.serving.weight_group import init_weight_group

    port = free_port()
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        pg = init_weight_group("127.0.0.1", port, rank=0, world_size=2, group_name="g", timeout=5)
        listening = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True).stdout
        assert listening.split()[3] == f"127.0.0.1:{port}", listening  # not *:port
        dist.broadcast(torch.ones(3), src=0, group=pg)
        assert peer.stdout.readline().strip() == "got [1.0, 1.0, 1.0]"
        peer.kill()
        peer.wait()
        t0 = time.time()
        with pytest.raises(RuntimeError):
            for _ in range(3):
                dist.broadcast(torch.ones(3), src=0, group=pg)
        assert time.time() - t0 < 5
        dist.destroy_process_group(pg)
    finally:
        peer.kill()
        peer.wait()

    t0 = time.time()
    with pytest.raises(Exception, match="timeout"):  # nobody joins: the rendezvous gives up after `timeout` s
        init_weight_group("127.0.0.1", free_port(), rank=0, world_size=2, group_name="h", timeout=2)
    assert time.time() - t0 < 10


THREAD_PARENT = """
import subprocess, sys, threading, time
from megappo.rollout.serving.process import REAPER

def start():
    subprocess.Popen([sys.executable, "-I", REAPER, str(__import__("os").getpid()), "--", "sleep", sys.argv[1]],
                     start_new_session=True)
    time.sleep(2)  # ends after the watchdog armed its parent-death signal (else the kernel never sends it)


thread = threading.Thread(target=start)
thread.start()
thread.join()
print("thread done", flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(60)
@pytest.mark.e2e
def test_the_watchdog_follows_the_process_not_the_thread_that_started_it():
    """PR_SET_PDEATHSIG fires when the starting *thread* ends (tools/sglang/check.py starts its server from one):
    the server must live on, and still die with the process."""
    marker = f"600.{free_port()}"  # a unique `sleep` argument to find it by

    def alive():
        return [args for _, _, stat, args in _ps() if args == f"sleep {marker}" and not stat.startswith("Z")]

    parent = subprocess.Popen([sys.executable, "-c", THREAD_PARENT, marker], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "thread done"
        _wait_for(alive, 10, "the command")
        time.sleep(2)  # the parent-death signal for the thread has come (a watchdog stopping on it: in 0.5 s)
        assert alive()
        parent.kill()
        parent.wait()
        _wait_for(lambda: not alive(), 10, "the command to die with the parent process")
    finally:
        parent.kill()
        parent.wait()
        for pid, _, _, args in _ps():
            if args == f"sleep {marker}":
                os.kill(pid, signal.SIGKILL)


@pytest.mark.e2e
@pytest.mark.sglang
@pytest.mark.long  # a whole server start for the command's wrapper; the server itself is tested above
def test_rollout_server_command_publishes_its_server_and_stops_it_on_sigterm(sglang_python, hf_model_dir, tmp_path):
    """`megappo rollout-server` (server nodes in launch/slurm/train_sglang.sbatch): once the server answers, the
    URL file (mode 0600) names it and the key read from --api-key-file (on no command line), the key works and
    another is refused; SIGTERM stops the server,
    removes the file and exits 0."""
    import json
    import stat

    url_file, key_file = tmp_path / "server-0.json", tmp_path / "api_key"
    key_file.write_text("5ec7e7k3y0f7h15j0b\n")
    proc = subprocess.Popen([sys.executable, "-m", "megappo.cli", "rollout-server", "--model", hf_model_dir("qwen2"),
                             "--url-file", str(url_file), "--host", "127.0.0.1", "--python", sglang_python,
                             "--api-key-file", str(key_file)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 300
        while not url_file.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        assert url_file.exists(), proc.communicate(timeout=30)[0][-3000:] if proc.poll() is not None else "timeout"
        assert stat.S_IMODE(url_file.stat().st_mode) == 0o600
        record = json.loads(url_file.read_text())
        assert record["api_key"] == "5ec7e7k3y0f7h15j0b"
        assert not any(record["api_key"] in args for *_, args in _ps())  # the key is on no command line
        port = int(record["url"].rsplit(":", 1)[1])
        groups = _server_groups(port)
        engine = SGLangEngine(record["url"], api_key=record["api_key"])
        out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True))
        assert len(out[0][0].output_ids) == 3
        with pytest.raises(RuntimeError, match="401"):
            http_json(record["url"] + "/model_info", timeout=10, api_key="not-the-key")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not url_file.exists()
    try:
        _wait_for(lambda: not _left(port, groups), 30, "the server's processes to exit")
    finally:
        _kill_leftovers(port, groups)
