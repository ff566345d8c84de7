"""The vLLM server megappo starts (`VLLMServer`) and its launcher (`launch.py`): the launch command and environment
built from the settings with the API key only in the environment, the launcher's refusal to serve without a key,
and its guard on every path checked against vLLM's own middleware (the vLLM environment of the `vllm_python`
fixture). The managed-process lifecycle a vLLM server goes through (a `FILE.py` launcher, the key in the environment,
a keyed identity path) runs here in a second with a stand-in server that guards every path as the launcher makes
vLLM do; tests/e2e/test_vllm_fleet.py runs the real server."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest

from megappo.rollout.serving.process import SHELTER, ManagedServer
from megappo.rollout.vllm import launch
from megappo.rollout.vllm.server import EXTENSION_DIR, LAUNCHER, VLLMServer, is_healthy


def _unstarted(server: ManagedServer) -> ManagedServer:
    server.stop()  # never started: closes and removes its empty log
    return server


def test_the_command_and_environment_carry_the_settings_and_never_the_key(tmp_path):
    s = _unstarted(VLLMServer(str(tmp_path), python="/venv/bin/python", port=8123, dtype="float16", max_num_seqs=8,
                              gpu_memory_utilization=0.3, tensor_parallel_size=2, max_num_batched_tokens=512,
                              enforce_eager=True, trust_remote_code=True, extra_args=["--seed", "3"], gpus=[2, 3],
                              api_key="k" * 48))
    assert s.cmd == ["/venv/bin/python", LAUNCHER, "--model", str(tmp_path), "--dtype", "float16",
                     "--host", "127.0.0.1", "--port", "8123", "--served-model-name", "megappo",
                     "--max-num-seqs", "8", "--gpu-memory-utilization", "0.3", "--tensor-parallel-size", "2",
                     "--generation-config", "vllm", "--worker-extension-cls", "megappo_vllm_ext.WeightReceiver",
                     "--max-num-batched-tokens", "512", "--enforce-eager",
                     "--trust-remote-code", "--seed", "3"]
    assert s.key_delivery() == ([], {"VLLM_API_KEY": "k" * 48})  # the environment of the start, not the argv
    assert not any("k" * 48 in a for a in s.cmd) and "VLLM_API_KEY" not in s.env
    assert s.env["VLLM_SERVER_DEV_MODE"] == "1" and s.env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert s.env["PYTHONPATH"] == EXTENSION_DIR and "RANK" not in s.env  # the extension's directory alone
    assert s._sheltered(s.cmd)[:3] == ["/venv/bin/python", SHELTER, LAUNCHER]  # job signals cannot reach it
    assert (s.url, s.KEYED_PATH, s.ENGINE) == ("http://127.0.0.1:8123", "/v1/models", "vLLM")


def test_a_cpu_server_reserves_little_host_memory_and_runs_eager(tmp_path):
    s = _unstarted(VLLMServer(str(tmp_path), cuda=False, gpu_memory_utilization=0.5, max_model_len=96))
    assert s.cmd[s.cmd.index("--gpu-memory-utilization") + 1] == "0.1" and "--enforce-eager" in s.cmd
    assert s.cmd[s.cmd.index("--max-model-len") + 1] == "96"
    assert s.env["VLLM_CPU_KVCACHE_SPACE"] == "1" and s.env["VLLM_TARGET_DEVICE"] == "cpu"


def test_optional_flags_stay_off_and_a_random_key_and_port_are_chosen(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    a, b = (_unstarted(VLLMServer(str(tmp_path))) for _ in range(2))
    assert not {"--max-num-batched-tokens", "--enforce-eager", "--trust-remote-code"} & set(a.cmd)
    assert a.env["CUDA_VISIBLE_DEVICES"] == "5"  # gpus=None: the caller's choice stands
    assert a.api_key != b.api_key and len(a.api_key) == 48 and a.port_auto and a.port > 0


@pytest.mark.parametrize("argv, env, error", [
    (["--model", "m"], {}, "VLLM_API_KEY is not set"),
    (["--model", "m", "--api-key", "x"], {"VLLM_API_KEY": "k"}, "not on the command line"),
    (["--model", "m", "--api-key=x"], {"VLLM_API_KEY": "k"}, "not on the command line"),
])
def test_the_launcher_refuses_to_serve_without_its_key_in_the_environment(argv, env, error, monkeypatch, capsys):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert launch.main(argv) == 2
    assert error in capsys.readouterr().err


# A stand-in for a vLLM server as megappo launches it: every path keyed (VLLM_API_KEY), /v1/models the keyed path.
_STAND_IN = """
import http.server, os, sys
KEY, PORT = os.environ["VLLM_API_KEY"], int(sys.argv[sys.argv.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        ok = self.headers.get("Authorization") == "Bearer " + KEY
        self.send_response(200 if ok else 401); self.send_header("Content-Length", "0"); self.end_headers()
http.server.ThreadingHTTPServer(("127.0.0.1", PORT), H).serve_forever()
"""


class _StandInServer(VLLMServer):
    def __init__(self, launcher: str, **kw):
        super().__init__("unused", python=sys.executable, **kw)
        self.launcher = launcher

    def command(self, port: int) -> list[str]:
        return [self.python, self.launcher, "--port", str(port)]


def test_a_file_launcher_with_its_key_in_the_environment_starts_answers_and_stops(tmp_path):
    script = tmp_path / "stand_in.py"
    script.write_text(textwrap.dedent(_STAND_IN))
    with _StandInServer(str(script)) as server:
        assert is_healthy(server.url, 5, server.api_key) and not is_healthy(server.url, 5, "not-the-key")
        children = subprocess.run(["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True).stdout
        pid = int(children.split()[0])
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert argv[1:3] == [SHELTER.encode(), str(script).encode()]  # through ignore_job_signals.py
        assert server.api_key.encode() not in b" ".join(argv)
        assert f"VLLM_API_KEY={server.api_key}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert not Path(f"/proc/{pid}").exists() or b"zombie" in Path(f"/proc/{pid}/status").read_bytes().lower()
    with pytest.raises(OSError):
        urllib.request.urlopen(server.url + "/health", timeout=2)


# vLLM's own AuthenticationMiddleware around a trivial app, with and without the launcher's guard: the status of
# each path asked with no key, a wrong key and the key
_ASGI = """
import asyncio, json, runpy, sys
try:
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware
except ImportError:
    sys.exit(3)

async def app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})

async def status(mw, path, key):
    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "headers": headers,
             "query_string": b""}
    sent = []
    async def receive(): return {"type": "http.request", "body": b"", "more_body": False}
    async def send(message): sent.append(message)
    await mw(scope, receive, send)
    return sent[0]["status"]

async def statuses():
    mw = AuthenticationMiddleware(app, tokens=["the-key"])
    paths = ["/pause", "/collective_rpc", "/update_weights", "/sleep", "/health", "/v1/models"]
    return {p: [await status(mw, p, k) for k in (None, "wrong", "the-key")] for p in paths}

out = {"before": asyncio.run(statuses())}
runpy.run_path(sys.argv[1], run_name="megappo_vllm_launch")["guard_every_path"]()
out["after"] = asyncio.run(statuses())
print(json.dumps(out))
"""


@pytest.mark.vllm
def test_the_launcher_puts_every_path_of_vllms_own_middleware_behind_the_key(vllm_python):
    done = subprocess.run([vllm_python, "-c", _ASGI, LAUNCHER], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["before"]["/collective_rpc"] == [200, 200, 200]  # vLLM alone: any worker method for anyone
    assert out["before"]["/v1/models"] == [401, 401, 200]
    assert out["after"] == {p: [401, 401, 200] for p in out["after"]}


def test_the_worker_extension_imports_nothing_of_megappo():
    """It runs in vLLM's environment, where megappo is not installed (its directory is the server's PYTHONPATH)."""
    import ast

    from megappo.rollout.vllm.server import EXTENSION_CLS, EXTENSION_DIR

    module, cls = EXTENSION_CLS.split(".")
    tree = ast.parse(Path(EXTENSION_DIR, f"{module}.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not [m for m in imported if m.split(".")[0] == "megappo"]
    assert cls in {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    assert set(os.listdir(EXTENSION_DIR)) <= {f"{module}.py", "__pycache__"}  # nothing else on the server's path
