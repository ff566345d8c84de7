"""Several vLLM servers behind the engine calls: megappo's `ServerFleet` (shares of rows over the live servers,
retries with each sample's seed, health checks, drop or revive) over `VLLMServerClient`s.

Weights reach the servers streamed from the trainer (rollout.weight_sync=distributed: one broadcast per bucket over
one group of the trainer and every server's workers, `weights.py` and megappo's worker extension) or from a Hugging
Face directory megappo writes (disk: every server's `reload_weights`); then each server's prefix cache is reset and
its version label set. Prompts go as token ids without images (a vision-language actor runs vLLM with
rollout.mode=sync)."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

from megappo.rollout.base import Bucket
from megappo.rollout.serving.fleet import ServerFleet
from megappo.rollout.vllm.client import NO_IMAGES, VLLMServerClient
from megappo.rollout.vllm.server import is_healthy


class VLLMFleet(ServerFleet):
    ENGINE = "vLLM"

    def __init__(self, urls: Sequence[str], *, api_key: Optional[str] = None, timeout: float = 600,
                 sync_timeout: float = 60, routes: Any = None, max_attempts: int = 3,
                 revive: Optional[Callable[[int], bool]] = None, health_check_interval_s: float = 30.0,
                 health_check_timeout_s: float = 5.0, max_concurrency: int = 256, tp_size: int = 1,
                 master_address: str = "127.0.0.1", backend: str = "gloo", eos_ids: Sequence[int] = ()):
        def client(url: str) -> VLLMServerClient:
            return VLLMServerClient(url, timeout=timeout, api_key=api_key, routes=routes, sync_timeout=sync_timeout,
                                    max_concurrency=max_concurrency, eos_ids=eos_ids)

        super().__init__(urls, client, healthy=is_healthy, max_attempts=max_attempts, revive=revive,
                         health_check_interval_s=health_check_interval_s,
                         health_check_timeout_s=health_check_timeout_s, max_concurrency=max_concurrency)
        self.engines: list[VLLMServerClient]
        self.tp_size, self.sync_timeout = tp_size, sync_timeout
        self.master_address, self.backend = master_address, backend  # the weight group's store and transport
        self._group: Any = None
        self._group_servers: list[int] = []
        self._flat_staging: list = []  # the flat send buffer, reused across syncs

    def _server_prompts(self, prompts, multi_modal):
        if multi_modal is not None and any(m is not None for m in multi_modal):
            raise NotImplementedError(NO_IMAGES)
        return [list(p) for p in prompts], None

    def _row_images(self, images, prompt_of_row):
        return None

    def _on_new_servers(self) -> None:
        # rebuilt at the next sync: a restarted server, even on its old port, is a new process in no group
        self.close_weight_group()

    def load_weights(self, buckets: Iterable[Bucket], *, version: int, mode: str = "distributed",
                     partial: bool = False) -> int:
        """Stream `buckets` into every live server (one broadcast each), then label them `version`. ValueError when
        a server reports a name its model lacks, or a layer that came in part (`weights.refused`): the version
        label then stays the old one. `partial`: the buckets hold some layers; the others stay as loaded."""
        from megappo.rollout.vllm import weights

        if mode != "distributed":
            raise ValueError(f"vLLM servers take streamed weights as rollout.weight_sync=distributed (or a directory: "
                             f"disk), not {mode!r}")
        if self._group is None or self._group_servers != self.live():
            self.close_weight_group()
            self._group_servers = self.live()
            self._group = weights.connect([self.engines[k] for k in self._group_servers], tp_size=self.tp_size,
                                          master_address=self.master_address, backend=self.backend,
                                          timeout_s=self.sync_timeout)
        clients = [self.engines[k] for k in self._group_servers]
        try:
            _, reports = weights.stream(self._group, clients, buckets, backend=self.backend,
                                        timeout_s=self.sync_timeout, staging=self._flat_staging)
        except BaseException:
            try:  # a failed broadcast leaves the group unusable: the next sync builds another
                self.close_weight_group()
            except Exception:  # noqa: BLE001 - the first error is the one to see
                pass
            raise
        for c in clients:
            c.reset_prefix_cache()
        problem = weights.refused(reports, partial)
        if problem:
            raise ValueError(f"vLLM weight sync to version {version}: {problem}")
        for c in clients:
            c.set_version(version)
        self.weight_version = version
        return version

    def close_weight_group(self) -> None:
        from megappo.rollout.vllm import weights

        if self._group is not None:
            group, self._group = self._group, None
            weights.leave(group, [self.engines[k] for k in self._group_servers if k < len(self.engines)])

    def close(self) -> None:
        try:
            self.close_weight_group()
        except Exception:  # noqa: BLE001 - the group of servers that are going away
            pass
        super().close()
