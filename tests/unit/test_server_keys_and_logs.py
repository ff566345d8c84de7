"""What a user of external rollout servers (`megappo rollout-server`, `rollout.server_urls`) and of the servers the
trainer starts sees, without a real engine (a stand-in HTTP server that keys every path, as megappo's vLLM launcher
makes vLLM do; tests/e2e/test_vllm_rollout_server.py runs the real one):

- the health check between steps sends the servers' key: a keyed external server stays live (it was dropped after
  one step, and the next step failed with "64 of 64 samples got no answer (live servers: [])");
- a server's log sits in the run's `servers/` folder, kept, and the fleet's error quotes its last lines;
- the server's temporary folder goes with it, whatever leftovers the engine put there (vLLM's `vllm_dist_<uuid>`);
- `~` in rollout.server_python (and rollout-server's --python) expands as in every other path;
- vLLM on CPU refuses, before anything starts, a model whose heads its CPU attention has no kernel for.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megappo.config import load_config
from megappo.rollout.serving.process import ManagedServer, free_port, server_log_path

R = "actor_rollout_ref.rollout"

# every path keyed (the key in KEY), a line in the log, and a leftover in its temporary folder as vLLM leaves one
_STAND_IN = """
import http.server, os, sys, tempfile
KEY, PORT = os.environ["KEY"], int(sys.argv[1])
open(os.path.join(tempfile.gettempdir(), "vllm_dist_0123abcd"), "w").close()
print("stand-in engine: serving", flush=True)
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        ok = self.headers.get("Authorization") == "Bearer " + KEY
        self.send_response(200 if ok else 401); self.send_header("Content-Length", "0"); self.end_headers()
http.server.ThreadingHTTPServer(("127.0.0.1", PORT), H).serve_forever()
"""


@pytest.fixture
def stand_in(tmp_path) -> str:
    script = tmp_path / "stand_in.py"
    script.write_text(textwrap.dedent(_STAND_IN))
    return str(script)


class _StandIn(ManagedServer):
    ENGINE = "vLLM"
    KEYED_PATH = "/v1/models"

    def __init__(self, script: str, **kw):
        super().__init__(python=sys.executable, **kw)
        self.script = script

    def command(self, port: int) -> list[str]:
        return [self.python, self.script, str(port)]

    def key_delivery(self):
        return [], {"KEY": self.api_key}


def _wait_up(url: str, key: str, timeout: float = 30) -> None:
    from megappo.rollout.serving.http_client import http_status

    deadline = time.monotonic() + timeout
    while http_status(url + "/health", key) != 200:
        assert time.monotonic() < deadline, f"the stand-in at {url} did not start"
        time.sleep(0.2)


@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_health_check_of_external_servers_sends_their_key(stand_in, one_rank, tmp_path):
    """Before every weight sync the trainer checks its servers; an external one (another process started it, so
    nothing registered its key here) answers only with the key, and must stay live."""
    from megappo.platform.device import detect_platform
    from megappo.rollout.serving.server_set import ServerSet
    from megappo.rollout.vllm.server import is_healthy
    from megappo.trainer.settings import rollout_settings

    port, key = free_port(), "k" * 48
    proc = subprocess.Popen([sys.executable, stand_in, str(port)], stdout=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "KEY": key, "TMPDIR": str(tmp_path)})
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_up(url, key)
        for given, live in ((key, [True]), ("not-the-key", [False])):
            cfg = load_config("cpu/tiny_ppo", [f"{R}.name=vllm", f"{R}.server_urls=[{url}]", f"{R}.api_key={given}",
                                               f"trainer.default_local_dir={tmp_path / 'run'}"])
            servers = ServerSet(rollout_settings(cfg), detect_platform("cpu"), None, healthy=is_healthy,
                                engine="vLLM")
            servers.start()
            servers.heal(set())
            assert servers.alive == live, given
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_a_servers_log_stays_in_the_run_folder_and_its_temporary_folder_goes(stand_in, tmp_path):
    log_dir = tmp_path / "run" / "servers"
    server = _StandIn(stand_in)
    server.keep_log_in(str(log_dir))
    with server:
        scratch = server.scratch
        assert (Path(scratch) / "vllm_dist_0123abcd").exists()  # its TMPDIR, not the machine's
    assert server.log.name == server_log_path(str(log_dir), "vLLM", server.url)
    assert Path(server.log.name).parent == log_dir and "stand-in engine: serving" in Path(server.log.name).read_text()
    assert not os.path.exists(scratch)


def test_a_killed_servers_temporary_folder_is_removed_by_its_watchdog(stand_in, tmp_path):
    server = _StandIn(stand_in)
    server.keep_log_in(str(tmp_path))
    server.start()
    scratch = server.scratch
    try:
        engine = int(subprocess.run(["pgrep", "-P", str(server.proc.pid)], capture_output=True,
                                    text=True).stdout.split()[0])
        os.kill(engine, signal.SIGKILL)  # the engine dies on its own; the watchdog sees it and exits
        server.proc.wait(timeout=30)
        assert not os.path.exists(scratch)
    finally:
        server.stop()


def test_the_fleets_error_quotes_the_dead_servers_log(tmp_path):
    from megappo.rollout.sampling import SamplingParams
    from megappo.rollout.vllm.fleet import VLLMFleet

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there: the server died
    Path(server_log_path(str(tmp_path), "vLLM", url)).write_text(
        "INFO starting\nRuntimeError: Unsupported CPU attention configuration: head_dim=16\n")
    fleet = VLLMFleet([url], api_key="k", timeout=5)
    fleet.log_dir = str(tmp_path)
    with pytest.raises(RuntimeError) as e:
        fleet.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, n=2))
    assert "2 of 2 samples got no answer" in str(e.value)
    assert "Unsupported CPU attention configuration: head_dim=16" in str(e.value) and "last 20 lines" in str(e.value)


def test_a_tilde_in_server_python_expands_as_in_other_paths(tmp_path, monkeypatch):
    from megappo.rollout import registry
    from megappo.trainer.settings import rollout_settings

    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").symlink_to(sys.executable)  # a python without vllm
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config("cpu/tiny_ppo", [f"{R}.name=vllm", f"{R}.server_python=~/venv/bin/python",
                                       "data.synthetic.name=digit_max_h32"])
    assert rollout_settings(cfg).server_python == str(tmp_path / "venv" / "bin" / "python")
    [problem] = registry.preflight(cfg)
    assert f"'{tmp_path}/venv/bin/python' has no vllm package" in problem  # run, not "cannot be run"


def test_rollout_server_expands_a_tilde_in_python(tmp_path, monkeypatch, capsys):
    from megappo.cli import main

    monkeypatch.setenv("HOME", str(tmp_path))
    rc = main(["rollout-server", "--engine", "vllm", "--model", str(tmp_path), "--url-file",
               str(tmp_path / "u.json"), "--python=~/nowhere/python"])
    assert rc == 2 and f"'{tmp_path}/nowhere/python' cannot be run" in capsys.readouterr().err


@pytest.mark.parametrize("overrides, refused", [
    ([], "heads of 16 dimensions (data.synthetic.name=digit_max's model)"),
    (["data.synthetic.name=digit_max_h32"], None),
    ([f"{R}.mode=sync"], "heads of 16 dimensions"),
    ([f"{R}.server_urls=[http://gpu-node:8000]"], None),  # someone else's server, on any device
    (["trainer.device=cuda"], None),
])
def test_vllm_on_cpu_refuses_heads_its_attention_has_no_kernel_for(overrides, refused):
    from megappo.rollout import registry

    cfg = load_config("cpu/tiny_ppo", [f"{R}.name=vllm", *overrides])
    problems = [p for p in registry.preflight(cfg) if "attention" in p]
    if refused is None:
        assert problems == []
    else:
        [problem] = problems
        assert refused in problem and "digit_max_h32" in problem and "32, 64" in problem


def test_the_head_size_is_read_from_the_models_config(tmp_path):
    import json

    from megappo.rollout.vllm.deploy import cpu_head_size_problems

    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4}))
    cfg = load_config("gsm8k/tiny_cpu", [f"{R}.name=vllm", f"actor_rollout_ref.model.path={tmp_path}",
                                          "trainer.device=cpu"])
    [problem] = cpu_head_size_problems(cfg)
    assert f"heads of 16 dimensions ({tmp_path}/config.json)" in problem and "digit_max_h32" not in problem
    cfg.actor_rollout_ref.model.override_config = {"num_attention_heads": 2}
    assert cpu_head_size_problems(cfg) == []
