"""The HTTP client of the SGLang servers against a local stand-in. `http_json` keeps connections to a server it
reaches without a proxy: back-to-back requests (a weight sync makes ~7 per server) share one TCP connection, a
connection the server closed meanwhile costs a new one and no request, and an error status still raises with the
server's message. `is_healthy` asks for one streamed token and wants the whole stream. A disk update whose cache
flush SGLang refused (its scheduler still counted the batch it had just run) is flushed again."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megappo.rollout.serving import http_client
from megappo.rollout.serving.http_client import http_json


class _Server:
    """A local HTTP/1.1 server that counts connections and requests; `close_after_answer` makes it drop each
    connection after answering without saying so (as uvicorn does with an idle keep-alive connection)."""

    def __init__(self, close_after_answer: bool = False):
        self.connections = self.requests = 0
        self.sockets: list = []
        self.bodies: list = []
        self.stream: bytes | None = None  # the body /generate answers with
        self.answers: dict[str, list[tuple[int, bytes]]] = {}  # path -> the answers to give it, in order
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self):
                outer.connections += 1
                outer.sockets.append(self.request)
                super().setup()

            def log_message(self, *args):
                pass

            def _answer(self, status: int, body: bytes) -> None:
                outer.requests += 1
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                self.wfile.flush()
                if close_after_answer:
                    self.close_connection = True

            def do_GET(self):
                if self.path == "/denied":
                    return self._answer(401, b'{"error": "bad key"}')
                self._answer(200, json.dumps({"path": self.path}).encode())

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.bodies.append(body)
                if outer.answers.get(self.path):
                    return self._answer(*outer.answers[self.path].pop(0))
                if self.path == "/generate" and outer.stream is not None:
                    return self._answer(200, outer.stream)
                self._answer(200, json.dumps({"got": body}).encode())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.handle_error = lambda *args: None  # a connection reset by close() is expected
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self):
        """Gone as a killed process is: the listening socket and every connection closed."""
        import socket

        self.httpd.shutdown()
        self.httpd.server_close()
        for sock in self.sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@pytest.fixture()
def pool(monkeypatch):
    monkeypatch.setattr(http_client, "_POOL", http_client._Pool())
    return http_client._POOL


def test_back_to_back_requests_share_one_connection(pool):
    server = _Server()
    try:
        for i in range(5):
            assert http_json(server.url + "/model_info", timeout=5) == {"path": "/model_info"}
            assert http_json(server.url + "/pause", {"i": i}, timeout=5) == {"got": {"i": i}}
        assert (server.connections, server.requests) == (1, 10)
        with pytest.raises(RuntimeError, match=r"/denied: HTTP 401: .*bad key"):
            http_json(server.url + "/denied", timeout=5)
        assert http_json(server.url + "/after", timeout=5) == {"path": "/after"}  # the error kept the connection
        assert server.connections == 1
    finally:
        server.close()


def test_a_connection_closed_by_the_server_is_replaced_and_no_request_is_doubled(pool):
    server = _Server(close_after_answer=True)
    try:
        for i in range(4):
            assert http_json(server.url + "/update", {"i": i}, timeout=5) == {"got": {"i": i}}
        assert server.requests == 4  # each POST reached the server once
        assert server.connections == 4
    finally:
        server.close()


def test_an_idle_connection_is_not_reused(pool):
    server = _Server()
    pool.max_idle_s = 0.0  # every kept connection is already too old
    try:
        for _ in range(3):
            http_json(server.url + "/x", timeout=5)
        assert server.connections == 3
    finally:
        server.close()


def test_a_server_that_is_gone_raises(pool):
    server = _Server()
    url = server.url
    http_json(url + "/x", timeout=5)  # leaves a kept connection to a server that then goes away
    server.close()
    with pytest.raises(OSError):
        http_json(url + "/x", timeout=5)


def test_only_servers_reached_without_a_proxy_get_kept_connections(monkeypatch):
    from megappo.rollout.serving.http_client import _direct

    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "no_proxy", "NO_PROXY", "all_proxy",
                "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    assert _direct("http://127.0.0.1:30000/generate") and _direct("http://node7:30000/generate")
    monkeypatch.setenv("http_proxy", "http://proxy.example:3128")
    assert _direct("http://127.0.0.1:30000/generate") and _direct("http://[::1]:30000/generate")
    assert not _direct("http://node7:30000/generate")  # urllib sends it to the proxy, as before
    monkeypatch.setenv("no_proxy", "node7")
    assert _direct("http://node7:30000/generate")


@pytest.mark.parametrize("stream, healthy", [
    (b'data: {"text": "a", "output_ids": [7], "meta_info": {"id": "x"}}\n\ndata: [DONE]\n\n', True),
    (b'data: {"error": {"message": "bad", "code": 400}}\n\ndata: [DONE]\n\n', False),
    (b'data: {"text": "a", "output_ids": [7]}\n\n', False),  # cut short
    (b'{"text": "a", "output_ids": [7]}', False),  # not a stream
])
def test_the_health_probe_is_one_streamed_token_and_wants_the_whole_stream(pool, stream, healthy):
    from megappo.rollout.sglang.health import is_healthy

    server = _Server()
    server.stream = stream
    try:
        assert is_healthy(server.url, timeout=5) is healthy
        assert server.bodies == [{"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                                  "stream": True}]
    finally:
        server.close()
    assert not is_healthy(server.url, timeout=5)  # gone


NOT_FLUSHED = (400, b'{"success": false, "message": "Weights were updated, but the cache was not flushed because '
                    b'requests are still running or queued. Retract or finish them, then call /flush_cache."}')


def test_a_refused_flush_after_a_disk_update_is_retried_until_the_scheduler_is_idle(pool, monkeypatch):
    from megappo.rollout.sglang import engine as sglang_engine
    from megappo.rollout.sglang.engine import SGLangEngine

    monkeypatch.setattr(sglang_engine, "_FLUSH_WITHIN_S", 0.2)

    server = _Server()
    server.answers = {"/update_weights_from_disk": [NOT_FLUSHED],
                      "/flush_cache": [(400, b"Cache not flushed"), (200, b"Cache flushed.\n")]}
    try:
        engine = SGLangEngine(server.url, sync_timeout=5)
        assert engine.update_weights_from_disk("/m", version=3) == 3 and engine.weight_version == 3
        assert server.bodies == [{"model_path": "/m", "weight_version": "3"}, {}, {}]

        server.answers = {"/update_weights_from_disk": [NOT_FLUSHED], "/flush_cache": [(400, b"busy")] * 100}
        with pytest.raises(RuntimeError, match="cache was not flushed.*flushing the cache then failed too"):
            engine.update_weights_from_disk("/m", version=4)
        assert engine.weight_version == 3
        server.answers = {"/update_weights_from_disk": [(400, b'{"success": false, "message": "no such file"}')]}
        with pytest.raises(RuntimeError, match="no such file"):
            engine.update_weights_from_disk("/m", version=5)
    finally:
        server.close()
