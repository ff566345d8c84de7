"""Start, probe and stop an SGLang server process, and talk JSON to it (standard library only).

SGLang lives in its own environment (it pins its own torch and transformers), so the server is started with that
environment's python (`python=`), and megappo only speaks HTTP to it. On a machine without CUDA the CPU flags are
added (`SGLANG_USE_CPU_ENGINE=1 --device cpu --attention-backend torch_native`); tools/sglang/install_cpu.sh
builds an environment in which that runs.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any, Optional, Sequence


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, payload: Any = None, timeout: float = 600) -> Any:
    """GET (payload None) or POST JSON; the decoded JSON answer. Raises RuntimeError with the server's message."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}: HTTP {e.code}: {e.read().decode(errors='replace')[:2000]}") from None


class SGLangServer:
    """One `python -m sglang.launch_server` process; a context manager that stops it (and its children)."""

    def __init__(self, model_path: str, *, python: str = "python", port: Optional[int] = None, cuda: bool = False,
                 dtype: str = "float32", max_total_tokens: int = 4096, extra_args: Sequence[str] = (),
                 trust_remote_code: bool = False):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [python, "-m", "sglang.launch_server", "--model-path", os.path.abspath(model_path),
                    "--dtype", dtype, "--host", "127.0.0.1", "--port", str(self.port),
                    "--max-total-tokens", str(max_total_tokens), "--disable-overlap-schedule", *extra_args]
        if trust_remote_code:  # SGLang runs code shipped with the model only when asked (model.trust_remote_code)
            self.cmd.append("--trust-remote-code")
        self.env = dict(os.environ)
        if not cuda:
            self.cmd += ["--device", "cpu", "--attention-backend", "torch_native"]
            self.env["SGLANG_USE_CPU_ENGINE"] = "1"
            self.env.setdefault("OMP_NUM_THREADS", "1")
        self.env["PYTHONPATH"] = ""  # the server's own environment, not the caller's
        self.proc: Optional[subprocess.Popen] = None
        self.log = tempfile.NamedTemporaryFile("w+", prefix="sglang_server_", suffix=".log", delete=False)

    def start(self, timeout: float = 600) -> float:
        """Launch and wait for GET /health; return the seconds it took. Raises RuntimeError with the log's tail."""
        t0 = time.time()
        # its own session, so the scheduler and detokenizer children stop with the server as one group
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                break
            try:
                http_json(self.url + "/health", timeout=5)
                return time.time() - t0
            except (RuntimeError, urllib.error.URLError, OSError, ValueError):
                time.sleep(1)
        self.stop()
        raise RuntimeError(f"SGLang server did not become healthy in {time.time() - t0:.0f} s "
                           f"(log {self.log.name}):\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return "".join(f.readlines()[-lines:])

    def stop(self) -> None:
        proc = self.proc
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=wait)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # children that outlived the parent
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc = None

    def __enter__(self) -> "SGLangServer":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
