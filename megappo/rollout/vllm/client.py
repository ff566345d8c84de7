"""One vLLM server as megappo's engines talk to it over HTTP (`vllm serve` 0.32 with VLLM_SERVER_DEV_MODE=1, as
`megappo.rollout.vllm.server.VLLMServer` starts it, or a running one in `rollout.server_urls`).

Generation is one `/v1/completions` request per sample (`requests.completion_request`: the sample's seed, token ids
in and out, the sampled token's log-prob, each token's weight version), sent concurrently and named by a request id
of this client's, so `abort` ends this client's requests only (other replicas share the server) and they answer with
the tokens they have. The control endpoints are vLLM's RL ones: `/pause?mode=keep` (in-flight requests freeze, none
is lost) and `/resume`; `/update_weight_version` and `/weight_info` (the served version); `/collective_rpc`
`reload_weights` (a Hugging Face directory, rollout.weight_sync=disk); `/v1/load_lora_adapter` (an adapter per
version, named by requests). The streamed transfer (rollout.weight_sync=distributed, gloo or NCCL) is the fleet's
(`megappo.rollout.vllm.weights`): one group for every server.
"""
from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Optional, Sequence

from megappo.rollout.base import Bucket, RolloutEngine
from megappo.rollout.sampling import Completion, SamplingParams
from megappo.rollout.seeds import request_seeds
from megappo.rollout.serving.http_client import http_json, http_text
from megappo.rollout.vllm.requests import (SERVED_MODEL, completion_request, engine_request_id, parse_choice,
                                           parse_prompt_logprobs, prompt_logprobs_request)

_IDS = itertools.count()


class VLLMServerClient(RolloutEngine):
    """A client of the vLLM server at `url` (the per-server client of `megappo.rollout.serving.fleet.ServerFleet`).
    routes: the served model's `RouteLayout` when completions carry routed experts (router replay R3). eos_ids: the
    served model's EOS ids (`requests.model_eos_ids`), sent as stop tokens."""

    def __init__(self, url: str, *, timeout: float = 600, api_key: Optional[str] = None, routes: Any = None,
                 sync_timeout: float = 60, max_concurrency: int = 256, eos_ids: Sequence[int] = (), **_: Any):
        self.url, self.timeout, self.api_key, self.routes = url.rstrip("/"), timeout, api_key, routes
        self.sync_timeout, self.max_concurrency, self.eos_ids = sync_timeout, max_concurrency, tuple(eos_ids)
        self.weight_version = 0
        self.model = SERVED_MODEL  # or the served LoRA adapter's name
        self._in_flight: set[str] = set()
        self._lock = threading.Lock()
        self._prefix = f"megappo-{os.getpid()}-{id(self):x}-"

    def _call(self, path: str, payload: Any = None, timeout: Optional[float] = None) -> Any:
        return http_json(self.url + path, payload, timeout=timeout or self.sync_timeout, api_key=self.api_key)

    # -- generation ------------------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, prompt_offset: int = 0,
                 multi_modal: Optional[Sequence[Any]] = None) -> list[list[Completion]]:
        if multi_modal is not None and any(m is not None for m in multi_modal):
            raise NotImplementedError(NO_IMAGES)
        rows = [i for i in range(len(prompts)) for _ in range(params.n)]
        seeds = request_seeds(params, len(prompts), prompt_offset)
        grouped: list[list[Completion]] = [[] for _ in prompts]
        for c in self.generate_rows([prompts[i] for i in rows], rows, seeds, params):
            grouped[c.prompt_index].append(c)
        return grouped

    def generate_rows(self, input_ids: Sequence[Sequence[int]], prompt_index: Sequence[int],
                      seeds: Sequence[Optional[int]], params: SamplingParams, *, batched: bool = True,
                      partial: bool = False, image_data: Optional[Sequence[Any]] = None) -> list[Completion]:
        """One completion per row (`input_ids[k]` drawn with `seeds[k]`), in row order; raises RuntimeError naming the
        server when a request fails or (without `partial`) is aborted. batched: unused (every row is a request)."""
        if image_data is not None and any(image_data):
            raise NotImplementedError(NO_IMAGES)
        if params.return_routed_experts and self.routes is None:
            raise ValueError("routed experts asked of a vLLM client given no route layout (a dense model?)")
        if not input_ids:
            return []
        with ThreadPoolExecutor(max_workers=max(1, min(self.max_concurrency, len(input_ids)))) as pool:
            futures = [pool.submit(self._one, ids, i, seed, params, partial)
                       for ids, i, seed in zip(input_ids, prompt_index, seeds)]
            return [f.result() for f in futures]

    def _one(self, ids: Sequence[int], prompt_index: int, seed: Optional[int], params: SamplingParams,
             partial: bool) -> Completion:
        request_id = f"{self._prefix}{next(_IDS)}"
        body = completion_request(ids, params, seed, request_id=request_id, model=self.model, eos_ids=self.eos_ids)
        version = self.weight_version
        with self._lock:
            self._in_flight.add(request_id)
        try:
            answer = http_json(self.url + "/v1/completions", body, timeout=self.timeout, api_key=self.api_key)
        finally:
            with self._lock:
                self._in_flight.discard(request_id)
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not choices or len(choices) != 1:
            raise RuntimeError(f"vLLM {self.url}/v1/completions answered {len(choices or [])} choices for one sample")
        return parse_choice(choices[0], prompt_index, weight_version=version, partial=partial,
                            routes=self.routes if params.return_routed_experts else None, engine=f"vLLM {self.url}")

    def abort(self) -> None:
        """This client's requests in flight end now, answering with the tokens they have (finish_reason abort)."""
        with self._lock:
            ids = sorted(self._in_flight)
        if ids:
            self._call("/abort_requests", {"request_ids": [engine_request_id(i) for i in ids]})

    def pause(self) -> None:
        self._call("/pause?mode=keep", {})

    def resume(self) -> None:
        self._call("/resume", {})

    def is_healthy(self, timeout: float = 5) -> bool:
        """Whether the server generates one greedy token within `timeout` seconds (what /health does not prove)."""
        try:
            probe = completion_request([0], SamplingParams(max_new_tokens=1, temperature=0.0), None,
                                       request_id=f"{self._prefix}health-{next(_IDS)}", model=SERVED_MODEL)
            answer = http_json(self.url + "/v1/completions", probe, timeout=timeout, api_key=self.api_key)
        except Exception:  # noqa: BLE001 - no answer in time, refused, an error status: unhealthy
            return False
        return isinstance(answer, dict) and len(answer.get("choices") or []) == 1

    # -- weights ---------------------------------------------------------------------------------------------------
    def set_version(self, version: int) -> int:
        """Label what the server now serves `version` (its completions' weight_versions carry it)."""
        self._call("/update_weight_version", {"new_version": str(int(version))})
        self.weight_version = int(version)
        return self.weight_version

    def served_version(self) -> Any:
        return self._call("/weight_info").get("weight_version")

    def check_version(self, version: int) -> None:
        served = self.served_version()
        if str(served) != str(int(version)):
            raise RuntimeError(f"vLLM server {self.url} serves weight version {served!r}, not {version}: it missed "
                               "the last weight sync")

    def update_weights_from_disk(self, model_path: str, *, version: int) -> int:
        """Reload the weights from a Hugging Face directory the server reads: vLLM's `reload_weights` through
        megappo's worker extension (`ext/megappo_vllm_ext.py`, which `VLLMServer` loads; a server of
        rollout.server_urls needs it too), which also refreshes a tied LM head."""
        from megappo.rollout.vllm.weights import without_extension

        try:
            self._call("/collective_rpc", {"method": "megappo_reload", "args": [str(model_path)]},
                       timeout=max(self.sync_timeout, 600))
        except RuntimeError as e:
            raise RuntimeError(f"{e}{without_extension(e)}") from None
        self.reset_prefix_cache()
        return self.set_version(version)

    def reset_prefix_cache(self) -> None:
        """Drop the cached prefixes: they hold the old weights' keys and values."""
        self._call("/reset_prefix_cache", {})

    def load_weights(self, buckets: Iterable[Bucket], *, version: int, mode: str = "distributed",
                     partial: bool = False) -> int:
        raise NotImplementedError("a single vLLM server takes streamed weights through its fleet's weight group "
                                  "(megappo.rollout.vllm.weights); use rollout.weight_sync=disk for one client")

    def load_lora_adapter(self, adapter_dir: str, *, version: int) -> int:
        """Serve `adapter_dir` as adapter `megappo-v<version>` (requests name it), the previous one unloaded."""
        name, timeout = f"megappo-v{int(version)}", max(self.sync_timeout, 600)
        # plain-text answers ("Success: LoRA adapter ... added successfully"); an error status raises
        http_text(self.url + "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapter_dir)},
                  timeout=timeout, api_key=self.api_key)
        previous, self.model = self.model, name
        if previous not in (SERVED_MODEL, name):
            http_text(self.url + "/v1/unload_lora_adapter", {"lora_name": previous}, timeout=timeout,
                      api_key=self.api_key)
        return self.set_version(version)

    # -- scoring ---------------------------------------------------------------------------------------------------
    def prompt_log_probs(self, token_ids: Sequence[int]) -> list[list[float]]:
        return [self._prompt_log_probs(token_ids)]

    def _prompt_log_probs(self, token_ids: Sequence[int]) -> list[float]:
        body = prompt_logprobs_request(token_ids, request_id=f"{self._prefix}{next(_IDS)}", model=self.model)
        answer = http_json(self.url + "/v1/completions", body, timeout=self.timeout, api_key=self.api_key)
        return parse_prompt_logprobs((answer.get("choices") or [{}])[0], token_ids, f"vLLM {self.url}")

    def sequence_log_probs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        if not sequences:
            return []
        with ThreadPoolExecutor(max_workers=max(1, min(self.max_concurrency, len(sequences)))) as pool:
            return list(pool.map(self._prompt_log_probs, sequences))


NO_IMAGES = ("vLLM servers take token-id prompts without images (its /v1/completions has no image field for them): "
              "serve a vision-language actor with actor_rollout_ref.rollout.mode=sync (vLLM in the trainer's "
              "ranks), or rollout.name=sglang or hf")
