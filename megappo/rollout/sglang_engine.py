"""A rollout engine that is a client of an SGLang server (or router): the same calls as `HFEngine`.

Requests go to SGLang's native `POST /generate` with token ids (no text round trip); a prompt's `n` samples are sent
as `n` rows, each with its own `sampling_seed` when the request has a seed. SGLang honours those seeds only when
the server runs with `--enable-deterministic-inference` (SGLang 0.5.23); otherwise sampling is not repeatable.
Weights reload from a Hugging Face directory (`/update_weights_from_disk`); the streamed, distributed update
belongs to the trainer's weight sync.

Log-probs are the server's `output_token_logprobs`; greedy ones equal `transformers`' log-softmax of the raw
logits (tools/sglang/check.py measures it).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from megappo.rollout.sampling import Completion, SamplingParams
from megappo.rollout.sglang_server import http_json


class SGLangEngine:
    def __init__(self, url: str, *, timeout: float = 600):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.weight_version = 0

    def _sampling_params(self, params: SamplingParams, row: int) -> dict[str, Any]:
        sp: dict[str, Any] = {
            "max_new_tokens": params.max_new_tokens,
            "temperature": 0.0 if params.is_greedy else params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "ignore_eos": params.ignore_eos,
            "no_stop_trim": True,  # keep the stop token in output_ids, as HFEngine does
        }
        if params.stop_token_ids:
            sp["stop_token_ids"] = list(params.stop_token_ids)
        if params.seed is not None:
            sp["sampling_seed"] = params.seed + row
        return sp

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        """`params.n` completions per prompt (token ids), grouped by prompt in request order."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        rows = [i for i in range(len(prompts)) for _ in range(params.n)]
        body = {
            "input_ids": [list(prompts[i]) for i in rows],
            "sampling_params": [self._sampling_params(params, r) for r in range(len(rows))],
            "return_logprob": True,
            "logprob_start_len": -1,
        }
        answer = http_json(self.url + "/generate", body, timeout=self.timeout)
        if isinstance(answer, dict):
            answer = [answer]
        grouped: list[list[Completion]] = [[] for _ in prompts]
        for i, item in zip(rows, answer):
            meta = item["meta_info"]
            reason = (meta.get("finish_reason") or {}).get("type", "length")
            if reason == "abort":
                raise RuntimeError(f"SGLang aborted a request: {meta.get('finish_reason')}")
            grouped[i].append(Completion(
                prompt_index=i, output_ids=list(item["output_ids"]),
                log_probs=[lp for lp, *_ in meta.get("output_token_logprobs", [])],
                finish_reason="stop" if reason == "stop" else "length",
                weight_version=self.weight_version, extra={"sglang_weight_version": meta.get("weight_version")}))
        return grouped

    def update_weights_from_disk(self, model_path: str, *, version: Optional[int] = None) -> int:
        """Reload the server's weights from a HF directory of the same architecture."""
        version = self.weight_version + 1 if version is None else version
        answer = http_json(self.url + "/update_weights_from_disk",
                           {"model_path": model_path, "weight_version": str(version)}, timeout=self.timeout)
        if not answer.get("success", False):
            raise RuntimeError(f"SGLang could not load {model_path}: {answer.get('message')}")
        self.weight_version = version
        return version
