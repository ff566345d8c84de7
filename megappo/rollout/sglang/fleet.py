"""Several SGLang servers behind the engine calls: the generation core every server engine shares (`ServerFleet`,
serving/fleet.py: shares, retries with each sample's seed, health checks, drop and revive, abort) over SGLang's
per-server clients (`SGLangEngine`), and SGLang's weight transport.

Weights go to every live server at once: one weight group holds the trainer (rank 0) and each server's TP ranks
(server k at ranks 1 + k * tp ...), so each bucket is broadcast once whatever the number of servers. Colocated
servers take them by handle instead (`update_weights_from_tensor`).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

from megappo.rollout.serving.fleet import ServerFleet
from megappo.rollout.serving.http_client import http_json
from megappo.rollout.serving.process import free_port
from megappo.rollout.serving.weight_group import unique_group_name
from megappo.rollout.sglang.engine import (Bucket, SGLangEngine, _join_all, _joined, _post_in_background,
                                           begin_update, broadcast_buckets, end_update)
from megappo.rollout.sglang.health import is_healthy
from megappo.rollout.sglang.vlm import row_images, sglang_prompts
from megappo.rollout.serving.weight_staging import SharedStaging


def _auth(engine: SGLangEngine) -> dict:
    """The keyword arguments that authenticate a request to `engine`'s server."""
    key = getattr(engine, "api_key", None)
    return {"api_key": key} if key else {}


class SGLangFleet(ServerFleet):
    ENGINE = "SGLang"

    def __init__(self, urls: Sequence[str], *, timeout: float = 600, tp_size: int = 1, max_attempts: int = 3,
                 revive: Optional[Callable[[int], bool]] = None, engine_kwargs: Optional[dict] = None,
                 master_address: str = "127.0.0.1", backend: str = "gloo", router_url: Optional[str] = None,
                 health_check_interval_s: float = 30.0, health_check_timeout_s: float = 5.0,
                 max_concurrency: int = 256):
        self.engine_kwargs = dict(engine_kwargs or {})
        self.timeout, self.tp_size = timeout, tp_size
        super().__init__(urls, self._engine, healthy=is_healthy, max_attempts=max_attempts, revive=revive,
                         router_url=router_url, health_check_interval_s=health_check_interval_s,
                         health_check_timeout_s=health_check_timeout_s, max_concurrency=max_concurrency)
        self.engines: list[SGLangEngine]
        self.master_address, self.backend = master_address, backend  # the weight group's store and transport
        self._group: Any = None
        self._group_servers: list[int] = []
        self._group_name = unique_group_name("megappo_fleet_weight_sync")
        self._flat_staging: list = []  # update_weights' flat send buffer, reused across syncs
        self._shm_staging = SharedStaging(slots=2)  # update_weights_from_tensor's shared buffers, idem

    def _engine(self, url: str) -> SGLangEngine:
        return SGLangEngine(url, timeout=self.timeout, tp_size=self.tp_size, **self.engine_kwargs)

    def _server_prompts(self, prompts, multi_modal):
        return sglang_prompts(prompts, multi_modal, self.engine_kwargs.get("image_token_id"))

    def _row_images(self, images, prompt_of_row):
        return row_images(images, prompt_of_row)

    def _on_new_servers(self) -> None:
        # the weight group is rebuilt at the next sync (a restarted server, even on its old port, is a new process
        # with no group)
        self.close_weight_group()

    def load_lora_adapter(self, adapter_dir: str, *, version: int) -> int:
        """rollout.lora_sync=adapter: every live server serves the PEFT adapter in `adapter_dir` as the actor
        (`SGLangEngine.load_lora_adapter`); the router's requests name it too."""
        super().load_lora_adapter(adapter_dir, version=version)
        for e in self.engines + ([self.router] if self.router is not None else []):
            e.serve_as(f"megappo_v{version}")
        return version

    # -- weights ---------------------------------------------------------------------------------------------------
    def connect_weight_group(self, *, backend: Optional[str] = None, master_address: Optional[str] = None,
                             master_port: Optional[int] = None, timeout_s: Optional[float] = None) -> Any:
        """One group: the trainer (rank 0) and every live server's TP ranks. The rendezvous store listens on
        `master_address` only (default: set at construction, else 127.0.0.1)."""
        from megappo.rollout.serving.weight_group import init_weight_group

        backend = backend or self.backend
        master_address = master_address or self.master_address
        timeout_s = self.engines[0].sync_timeout if timeout_s is None else timeout_s
        port = master_port or free_port()
        servers = self.live()
        world = 1 + len(servers) * self.tp_size
        posts = []
        for j, k in enumerate(servers):
            body = {"master_address": master_address, "master_port": port, "rank_offset": 1 + j * self.tp_size,
                    "world_size": world, "group_name": self._group_name, "backend": backend}
            posts.append(_post_in_background(self.engines[k].url + "/init_weights_update_group", body,
                                             timeout_s, **_auth(self.engines[k])))
        self._group = init_weight_group(master_address, port, rank=0, world_size=world, group_name=self._group_name,
                                        backend=backend, timeout=timeout_s)
        self._group_servers = servers
        for thread, result in posts:
            _joined(thread, result, "init_weights_update_group")
        return self._group

    def update_weights(self, buckets: Iterable[Bucket], *, version: Optional[int] = None) -> int:
        """Stream checkpoint-named tensors into every server of the group: each bucket is announced to each server,
        then broadcast once (`sglang_engine.broadcast_buckets`)."""

        if self._group is None or self._group_servers != self.live():
            self.close_weight_group()
            self.connect_weight_group()
        version = self.weight_version + 1 if version is None else version
        engines = [self.engines[k] for k in self._group_servers]
        broadcast_buckets(engines, buckets, self._group, self._group_name, version, self._flat_staging)
        self.weight_version = version
        return version

    def update_weights_from_tensor(self, buckets: Iterable[Bucket], *, version: Optional[int] = None) -> int:
        """Colocated servers (same machine): each bucket goes by handle, not by value. CPU tensors are copied into
        shared-memory buffers kept across syncs (`weight_staging.SharedStaging`, two buckets' worth: the next
        bucket is staged while the servers copy out of the previous one); CUDA tensors go by CUDA IPC as they are.
        A slot is reused only after every server answered for it, i.e. copied it into its parameters."""
        import base64

        version = self.weight_version + 1 if version is None else version
        engines = [self.engines[k] for k in self.live()]
        staging = self._shm_staging
        begin_update(engines)
        pending: list[list] = [[] for _ in staging.buffers]  # per slot: the posts still reading it
        kept: list = [None] * len(pending)  # per slot: CUDA tensors sent as they are, alive until answered
        try:
            for i, bucket in enumerate(buckets):
                slot = i % len(pending)
                _join_all(pending[slot], "update_weights_from_tensor")
                staged = list(bucket) if any(t.is_cuda for _, t in bucket) else staging.stage(slot, bucket)
                kept[slot] = staged
                for e in engines:  # one payload per receiving rank: each unpickling releases one reference
                    body = {"serialized_named_tensors": [base64.b64encode(staging.handles(staged)).decode()
                                                         for _ in range(self.tp_size)],
                            "flush_cache": True, "weight_version": str(version)}
                    pending[slot].append(_post_in_background(e.url + "/update_weights_from_tensor", body,
                                                             e.sync_timeout, **_auth(e)))
        except BaseException:
            for posts in pending:
                _join_all(posts, "update_weights_from_tensor", check=False)
            raise
        for posts in pending:
            _join_all(posts, "update_weights_from_tensor")
        end_update(engines)
        self.weight_version = version
        return version

    def load_weights(self, buckets: Iterable[Bucket], *, version: int, mode: str = "distributed",
                     partial: bool = False) -> int:
        """The trainer's weight sync: one broadcast per bucket (distributed) or by handle (tensor: colocated).
        A server takes any subset of its parameters: `partial` needs nothing more."""
        send = self.update_weights_from_tensor if mode == "tensor" else self.update_weights
        return send(buckets, version=version)

    def needs_copies(self, mode: str) -> bool:
        # CUDA IPC hands the servers the tensors' own memory: views of the parameters would change under them
        return mode == "tensor" and self.backend == "nccl"

    def close(self) -> None:
        self.shutdown_submitter()
        try:
            self.close_weight_group()
        except Exception:  # noqa: BLE001 - the group of a server that is going away
            pass
        super().close()

    def close_weight_group(self) -> None:
        import torch.distributed as dist

        if self._group is not None:
            for k in self._group_servers:
                e = self.engines[k]
                try:
                    http_json(e.url + "/destroy_weights_update_group", {"group_name": self._group_name},
                              timeout=10, **_auth(e))
                except Exception:  # noqa: BLE001 - a server that is gone has no group left
                    pass
            dist.destroy_process_group(self._group)
            self._group = None

