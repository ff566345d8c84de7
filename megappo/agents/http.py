"""The endpoint's HTTP layer (stdlib `ThreadingHTTPServer`, one thread per connection, HTTP/1.1 keep-alive): it
checks the request's framing and size before reading its body, bounds the requests served at once, and hands the
Authorization header and body to the endpoint (`chat`, `models`), whose `Reply` it writes. No request can take a
server thread down: anything raised becomes a 500.
"""
from __future__ import annotations

import json
import logging
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional

from megappo.agents.openai_format import error_json

logger = logging.getLogger(__name__)
_DISCARD_LIMIT = 16 << 20  # an oversized body up to this is read and dropped so the client sees its 413


@dataclass
class Reply:
    status: int
    content_type: str
    body: bytes
    on_sent: Optional[Callable[[], None]] = None  # called once the whole response was written

    @staticmethod
    def json(status: int, obj: Any, on_sent: Optional[Callable[[], None]] = None) -> "Reply":
        return Reply(status, "application/json", json.dumps(obj).encode(), on_sent)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024  # the listen backlog: socketserver's 5 resets agents that connect together

    def __init__(self, address, handler, owner: "HttpServer"):
        self.owner = owner
        super().__init__(address, handler)

    def handle_error(self, request, client_address) -> None:  # a client that went away: no traceback on stderr
        logger.debug("agent endpoint: connection from %s ended with an error", client_address, exc_info=True)

    def process_request(self, request, client_address):
        if not self.owner.admit(request):  # too many connections: closed at once
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self) -> None:
        self.timeout = self.server.owner.settings.socket_timeout_s  # a stalled client is dropped
        super().setup()
        # one write per response and no Nagle: headers and body in two segments would wait out the client's
        # delayed ACK (40 ms a call)
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.owner.release(self.connection)

    def log_message(self, format: str, *args: Any) -> None:  # one line per request is noise at agent rates
        pass

    def _send(self, reply: Reply) -> None:
        try:
            self.send_response(reply.status)
            self.send_header("Content-Type", reply.content_type)
            self.send_header("Content-Length", str(len(reply.body)))
            if reply.content_type == "text/event-stream":
                self.send_header("Cache-Control", "no-cache")
            if self.close_connection:
                self.send_header("Connection", "close")
            self._headers_buffer.append(b"\r\n")
            self.wfile.write(b"".join(self._headers_buffer) + reply.body)
            self._headers_buffer = []
            self.wfile.flush()
        except OSError:  # the client went away (or the server is stopping): nothing to answer
            self.close_connection = True
            return
        if reply.on_sent is not None:
            reply.on_sent()

    def _refuse(self, status: int, message: str) -> None:
        self._send(Reply.json(status, error_json(status, message)))

    def _body(self) -> Optional[bytes]:
        """The request body, or None after refusing it (411, 413)."""
        limit = self.server.owner.settings.max_body_bytes
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            self._refuse(411, "send the body with a Content-Length (no chunked transfer encoding)")
            return None
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            length = -1
        if length < 0:
            self.close_connection = True
            self._refuse(411, "a Content-Length header is required")
            return None
        if length > limit:
            self.close_connection = True
            left = length if length <= _DISCARD_LIMIT else 0  # drained: the client reads the 413, not a reset
            while left > 0:
                chunk = self.rfile.read(min(1 << 16, left))
                if not chunk:
                    break
                left -= len(chunk)
            self._refuse(413, f"the request body is over {limit} bytes")
            return None
        return self._read(length)

    def _read(self, length: int) -> Optional[bytes]:
        """`length` bytes within `socket_timeout_s` in all (a client trickling its body is dropped, 408)."""
        deadline = time.monotonic() + self.server.owner.settings.socket_timeout_s
        chunks, left = [], length
        while left > 0:
            if time.monotonic() > deadline:
                self.close_connection = True
                self._refuse(408, "the request body took too long to arrive")
                return None
            chunk = self.rfile.read1(min(left, 1 << 16))
            if not chunk:
                self.close_connection = True
                return None
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def do_POST(self) -> None:
        owner = self.server.owner
        if self.path.split("?")[0].rstrip("/") != "/v1/chat/completions":
            self.close_connection = True
            self._refuse(404, f"no such endpoint: POST {self.path[:200]}")
            return
        body = self._body()  # read before taking a slot: a slow sender holds a connection, not a slot
        if body is None:
            return
        if not owner.slots.acquire(blocking=False):
            self._refuse(429, "too many requests in flight; retry")
            return
        try:
            reply = owner.endpoint.chat(self.headers.get("Authorization"), body)
        except Exception as e:  # never a dead thread: the client gets the error
            reply = Reply.json(500, {"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error",
                                               "code": 500}})
        finally:
            owner.slots.release()
        self._send(reply)

    def do_GET(self) -> None:
        if self.path.split("?")[0].rstrip("/") != "/v1/models":
            self._refuse(404, f"no such endpoint: GET {self.path[:200]}")
            return
        try:
            reply = self.server.owner.endpoint.models(self.headers.get("Authorization"))
        except Exception as e:
            reply = Reply.json(500, {"error": {"message": str(e), "type": "server_error", "code": 500}})
        self._send(reply)


class HttpServer:
    """The listening socket and its connections; `stop` drops every connection (in-flight responses fail)."""

    def __init__(self, endpoint, settings):
        self.endpoint, self.settings = endpoint, settings
        self.host, self.port = settings.host, settings.port
        self.slots = threading.BoundedSemaphore(settings.max_concurrent_requests)
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._server: Optional[_Server] = None
        self._thread: Optional[threading.Thread] = None

    def admit(self, connection: socket.socket) -> bool:
        with self._lock:
            if len(self._connections) >= 4 * self.settings.max_concurrent_requests:
                return False
            self._connections.add(connection)
            return True

    def release(self, connection: socket.socket) -> None:
        with self._lock:
            self._connections.discard(connection)

    def start(self, port: int) -> None:
        self._server = _Server((self.host, port), _Handler, self)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="megappo-agent-http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        with self._lock:
            connections, self._connections = list(self._connections), set()
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=10)
