"""Several vLLM servers behind the engine calls: megappo's `ServerFleet` (shares of rows over the live servers,
retries with each sample's seed, health checks, drop or revive) over `VLLMServerClient`s.

Weights reach the servers from a Hugging Face directory megappo writes (rollout.weight_sync=disk: every server's
`reload_weights`, then its version label); vLLM's NCCL weight transfer needs CUDA and is not wired yet. Prompts go as
token ids without images (a vision-language actor runs vLLM with rollout.mode=sync)."""
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
                 health_check_timeout_s: float = 5.0, max_concurrency: int = 256):
        def client(url: str) -> VLLMServerClient:
            return VLLMServerClient(url, timeout=timeout, api_key=api_key, routes=routes, sync_timeout=sync_timeout,
                                    max_concurrency=max_concurrency)

        super().__init__(urls, client, healthy=is_healthy, max_attempts=max_attempts, revive=revive,
                         health_check_interval_s=health_check_interval_s,
                         health_check_timeout_s=health_check_timeout_s, max_concurrency=max_concurrency)

    def _server_prompts(self, prompts, multi_modal):
        if multi_modal is not None and any(m is not None for m in multi_modal):
            raise NotImplementedError(NO_IMAGES)
        return [list(p) for p in prompts], None

    def _row_images(self, images, prompt_of_row):
        return None

    def load_weights(self, buckets: Iterable[Bucket], *, version: int, mode: str = "disk",
                     partial: bool = False) -> int:
        raise ValueError(f"vLLM servers take the weights from a directory (rollout.weight_sync=disk), not {mode!r}: "
                         "vLLM's streamed transfer (NCCL) needs CUDA and is not wired yet")
