"""sglang-router in front of SGLang servers: started, checked and reaped like the servers themselves.

`rollout.router: sglang` puts the real `sglang-router` (installed beside SGLang) between the trainer and its
servers. Generation requests go to the router, which spreads them over its workers (`rollout.router_policy`) and
retries on another worker when one fails; weight syncs, pauses and version checks still go to every server directly
(the router has no weight-update endpoints).

The router runs under the same watchdog as a server (`platform/reaper.py`: it dies with the process that started
it) and is ours by the same test: it takes our API key and refuses another. The key also authenticates the router to its
workers. It reaches the router through a 0600 file that a tiny launcher reads and deletes, never on a command line.
The router is ready when it lists every worker healthy.
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Optional, Sequence

from megappo.rollout.serving.http_client import http_json, http_status
from megappo.rollout.serving.process import ManagedServer

# Reads the router's argument list from a file (the API key among them), deletes it, runs the router.
_LAUNCHER = ("import json, os, sys; f = sys.argv[1]; a = json.load(open(f)); os.unlink(f); "
             "from sglang_router.launch_router import launch_router, parse_router_args; "
             "launch_router(parse_router_args(a))")


class SGLangRouter(ManagedServer):
    """`python -m sglang_router.launch_router` over `worker_urls`, under a watchdog; `url` takes generation."""

    ENGINE = "SGLang"  # its messages are the servers' ("SGLang server ...")

    def __init__(self, worker_urls: Sequence[str], *, python: str, api_key: str, host: str = "127.0.0.1",
                 port: Optional[int] = None, policy: str = "round_robin", health_check_interval_s: float = 30,
                 health_check_timeout_s: float = 5, request_timeout_s: float = 600, extra_args: Sequence[str] = ()):
        if not api_key:
            raise ValueError("the router needs the servers' API key")
        self.worker_urls = list(worker_urls)
        self._router_args = [
            "--worker-urls", *self.worker_urls, "--host", host, "--policy", policy,
            "--health-check-interval-secs", str(max(1, int(health_check_interval_s))),
            "--health-check-timeout-secs", str(max(1, int(health_check_timeout_s))),
            "--request-timeout-secs", str(max(1, int(request_timeout_s))),
            "--log-level", "warn", *extra_args]
        super().__init__(python=python, port=port, host=host, api_key=api_key)
        self.env.pop("SGLANG_USE_CPU_ENGINE", None)

    def command(self, port: int) -> list[str]:
        return [self.python, "-I", "-c", _LAUNCHER]  # the argument file follows (`key_delivery`)

    def key_delivery(self) -> tuple[list[str], dict[str, str]]:
        fd, self._key_file = tempfile.mkstemp(prefix="sglang_router_", suffix=".json")  # mode 0600
        with os.fdopen(fd, "w") as f:
            json.dump([*self._router_args, "--port", str(self.port), "--api-key", self.api_key], f)
        return [self._key_file], {}

    def _answers_as_ours(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            return False
        workers = self.url + "/workers"
        if http_status(workers, self.api_key) != 200 or http_status(workers, "not-" + self.api_key) != 401:
            return False
        return len(self.healthy_workers()) == len(self.worker_urls)

    def bind_failed(self, tail: str) -> bool:
        return "Address already in use" in tail or "address already in use" in tail

    def healthy_workers(self) -> list[str]:
        """The worker URLs the router currently sends requests to."""
        try:
            listing = http_json(self.url + "/workers", timeout=5, api_key=self.api_key)
        except Exception:  # noqa: BLE001 - not up yet, or gone
            return []
        return sorted(w["url"] for w in listing.get("workers", []) if w.get("is_healthy"))
