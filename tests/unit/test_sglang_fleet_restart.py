"""The fleet's view of a restarted server (rollout.lora_sync=adapter). SGLang's CPU backend cannot serve LoRA (it
dies at start with --enable-lora, measured with 0.5.23), so the adapter endpoints are answered here by a local
stand-in that keeps, per process, the adapters it has loaded and refuses to unload one it never loaded, as SGLang
does; the GPU test (tests/gpu/test_gpu_sglang_lora.py) runs the real server.

A server restarted on its old port is a new process that serves the base alone: the fleet must give it the current
adapter and, at the next sync, must not ask it to unload an adapter only the old process had."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megappo.rollout.serving import http_client
from megappo.rollout.sglang.fleet import SGLangFleet


class _LoRAServer:
    """One server process's LoRA endpoints: `adapters` is what it serves; `calls` the (path, lora_name) it got."""

    def __init__(self, port: int = 0):
        self.adapters: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                name = body.get("lora_name", "")
                outer.calls.append((self.path, name))
                if self.path == "/load_lora_adapter":
                    outer.adapters.add(name)
                    answer = {"success": True}
                elif self.path == "/unload_lora_adapter":
                    ok = name in outer.adapters
                    outer.adapters.discard(name)
                    answer = {"success": ok, "message": "" if ok else f"LoRA adapter {name} is not loaded"}
                else:
                    answer = {"success": True}
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture()
def pool(monkeypatch):
    monkeypatch.setattr(http_client, "_POOL", http_client._Pool())
    http_client._POOL.max_idle_s = 0.0  # no kept connection outlives the process it went to
    return http_client._POOL


def test_a_restarted_server_gets_the_current_adapter_and_the_next_sync_works(pool, tmp_path):
    servers = [_LoRAServer(), _LoRAServer()]
    try:
        fleet = SGLangFleet([s.url for s in servers])
        assert fleet.load_lora_adapter(str(tmp_path / "lora_v1"), version=1) == 1
        assert all(s.adapters == {"megappo_v1"} for s in servers)

        fleet.alive[1] = False  # the fleet saw server 1 fail; it is restarted on its old port, serving the base
        port = servers[1].port
        servers[1].close()
        servers[1] = _LoRAServer(port)
        fleet.set_servers([s.url for s in servers], [True, True])
        assert servers[1].adapters == {"megappo_v1"}  # the current adapter, before any request names it
        assert fleet.weight_version == 1

        assert fleet.load_lora_adapter(str(tmp_path / "lora_v2"), version=2) == 2
        assert all(s.adapters == {"megappo_v2"} for s in servers)
        assert [c for c in servers[1].calls if c[0] == "/unload_lora_adapter"] == [("/unload_lora_adapter",
                                                                                   "megappo_v1")]
        assert [e.lora_name for e in fleet.engines] == ["megappo_v2", "megappo_v2"]
    finally:
        for s in servers:
            s.close()
