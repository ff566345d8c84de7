"""The rollout servers of a run, SGLang's or vLLM's: where they start, the router in front of them, and what happens
when one dies. What server i on port p is (its engine, flags and GPUs) is the engine's `ServerFactory`.

Started servers (no `rollout.server_urls`): each node's first rank starts `rollout.servers_per_node` of them (by
default one per `rollout.tensor_model_parallel_size` GPUs of the node, one on a CPU node), all at once, server i on
GPUs i*tp ... i*tp+tp-1. Every server of the run shares one random API key (or `rollout.api_key`), broadcast from
rank 0, so any rank may talk to any server. With a `RouterFactory` (SGLang's, for `rollout.router: sglang`), rank 0
also starts a router over all of them.

Healing is collective and runs before every weight sync: ranks report the servers their clients dropped, each node
checks its own servers (process alive, the engine's health probe), and a dead one is restarted on its old
port (`rollout.restart_failed_servers`), or dropped. The sync that follows gives a restarted server the current weights
before it serves again. Running servers named in `rollout.server_urls` cannot be restarted; one that generates
again rejoins (and gets the weights at that sync).
"""
from __future__ import annotations

import os
import secrets
import sys
import threading
from typing import Any, Callable, Optional

import torch.distributed as dist

from megappo.platform.device import Platform
from megappo.rollout.serving.http_client import HealthProbe, read_api_key_file
from megappo.rollout.serving.process import ManagedServer
from megappo.rollout.settings import RolloutSettings

# server `index` of its node, on `port` (None: the engine's choice), with the run's API key; not started yet
ServerFactory = Callable[[int, Optional[int], str], ManagedServer]
# a router over these server URLs with the run's API key; not started yet
RouterFactory = Callable[[list[str], str], ManagedServer]


def _all_gather(obj: Any) -> list:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _broadcast(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def configured_api_key(rollout: RolloutSettings) -> Optional[str]:
    """The key the config names: `rollout.api_key`, else the first line of `rollout.api_key_file`, else None."""
    return read_api_key_file(rollout.api_key_file) if rollout.api_key_file else rollout.api_key


class ServerSet:
    """The run's servers as every rank agrees on them: `urls` (node order), `alive`, `api_key`, `router_url`.
    `server(i, port, key)` makes the node's server i; `healthy(url, timeout, key)` probes one; `router`, when
    given, makes the router in front of them all; `engine` names them in messages ("SGLang", "vLLM")."""

    def __init__(self, settings: RolloutSettings, platform: Platform, server: ServerFactory, *,
                 healthy: HealthProbe, engine: str, router: Optional[RouterFactory] = None):
        self.r = settings
        self.platform = platform
        self.make_server, self.healthy, self.engine, self.make_router = server, healthy, engine, router
        self.external = bool(self.r.server_urls)
        # LOCAL_RANK is torchrun's; a process started otherwise is alone on its node
        self.starter = not self.external and int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0
        self.servers: list[ManagedServer] = []
        self.router: Optional[ManagedServer] = None
        self.urls: list[str] = list(self.r.server_urls)
        self.alive: list[bool] = [True] * len(self.urls)
        self.api_key: Optional[str] = configured_api_key(self.r)
        self.router_url: Optional[str] = None
        self.restarts = 0

    # -- start -----------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Collective: every node's servers up, then the router; all ranks learn the URLs and the key."""
        if not self.external:
            self.api_key = _broadcast((self.api_key or secrets.token_hex(24)) if dist.get_rank() == 0 else None)
            error = None
            if self.starter:
                try:
                    self.servers = self._start_many(range(self.per_node()))
                except Exception as e:  # noqa: BLE001 - every rank raises it below, none waits forever
                    error = f"rank {dist.get_rank()}: {e}"
            reports = _all_gather((error, [s.url for s in self.servers]))
            errors = [e for e, _ in reports if e]
            if errors:
                raise RuntimeError(f"starting the {self.engine} servers failed: " + "\n".join(errors))
            self.urls = [u for _, urls in reports for u in urls]
            self.alive = [True] * len(self.urls)
        if self.make_router is not None:
            self._start_router()

    def per_node(self) -> int:
        if self.r.servers_per_node:
            return self.r.servers_per_node
        if self.platform.is_cuda:
            import torch

            return max(1, torch.cuda.device_count() // self.r.tensor_model_parallel_size)
        return 1

    def _start_many(self, indices, ports: Optional[dict] = None) -> list[ManagedServer]:
        """Start servers concurrently (a cold start is mostly waiting); all of them, or none (raises)."""
        servers = [self.make_server(i, (ports or {}).get(i), self.api_key) for i in indices]
        if self.r.log_dir:  # the run's folder: the logs outlive the servers, and the fleet's errors quote them
            for s in servers:
                s.keep_log_in(self.r.log_dir)
        errors: list = [None] * len(servers)

        def run(j: int) -> None:
            try:
                servers[j].start(timeout=self.r.server_start_timeout_s)
            except BaseException as e:  # noqa: BLE001 - reported below, after every start has ended
                errors[j] = e

        threads = [threading.Thread(target=run, args=(j,), daemon=True) for j in range(len(servers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if any(errors):
            for s in servers:
                s.stop()
            raise next(e for e in errors if e)
        return servers

    def _start_router(self) -> None:
        url = None
        if dist.get_rank() == 0:
            if self.router is not None:
                self.router.stop()
            live = [u for u, ok in zip(self.urls, self.alive) if ok]
            self.router = self.make_router(live, self.api_key)
            self.router.start(timeout=self.r.server_start_timeout_s)
            url = self.router.url
        self.router_url = _broadcast(url)

    # -- heal ------------------------------------------------------------------------------------------------------
    def heal(self, dropped: set[str]) -> bool:
        """Collective: restart or drop dead servers, readmit recovered external ones; True when the set changed
        (every rank's client must then take `urls`/`alive`)."""
        dropped = set().union(*_all_gather(sorted(dropped)))
        before, restarts = (list(self.urls), list(self.alive)), self.restarts
        if self.external:
            if dist.get_rank() == 0:  # their key: nothing registered it for their URLs in this process
                self.alive = [self.healthy(u, self.r.health_check_timeout_s, self.api_key) for u in self.urls]
            self.alive = _broadcast(self.alive)
        else:
            mine = self._heal_mine(dropped) if self.starter else []
            reports = _all_gather((mine, self.restarts))
            self.urls = [u for servers, _ in reports for u, _ok in servers]
            self.alive = [ok for servers, _ in reports for _u, ok in servers]
            self.restarts = sum(n for _, n in reports)
        changed = (self.urls, self.alive) != before or bool(dropped) or self.restarts != restarts
        if changed and self.make_router is not None and self.urls != before[0]:
            self._start_router()  # a server came back on another port: the router's list is stale
        return changed

    def _heal_mine(self, dropped: set[str]) -> list[tuple[str, bool]]:
        out = []
        for i, s in enumerate(self.servers):
            if s.proc is not None and s.proc.poll() is None and s.url not in dropped and \
                    self.healthy(s.url, self.r.health_check_timeout_s, self.api_key):
                out.append((s.url, True))
                continue
            print(f"megappo rollout: {self.engine} server {s.url} is dead" +
                  ("; restarting it" if self.r.restart_failed_servers else "; dropped") +
                  f" (log {s.log.name}, last lines:\n{s.log_tail(20)})", file=sys.stderr, flush=True)
            s.failed = True
            s.stop()
            if self.r.restart_failed_servers:
                try:
                    self.servers[i] = self._restart(i, s.port)
                    self.restarts += 1
                    out.append((self.servers[i].url, True))
                    continue
                except Exception as e:  # noqa: BLE001 - the run goes on with the other servers
                    print(f"megappo rollout: restarting {self.engine} server {i} failed ({e}); it is dropped",
                          file=sys.stderr, flush=True)
            out.append((s.url, False))
        return out

    def _restart(self, index: int, port: int) -> ManagedServer:
        try:  # its old port first: clients and the router know that URL
            return self._start_many([index], {index: port})[0]
        except RuntimeError as e:
            if "is taken" not in str(e):
                raise
            return self._start_many([index])[0]

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
            self.router = None
        for s in self.servers:
            s.stop()
        self.servers = []
