"""megappo's sampling requests as vLLM takes them, and vLLM's answers as megappo's completions (pure: no vLLM import,
no I/O), for both deployments: a server's `/v1/completions` (`completion_request`, `parse_choice`) and the engine in
this process (`sampling_kwargs` for `vllm.SamplingParams`, `parse_output`).

What megappo asks of vLLM (0.32, `megappo[vllm]`'s pin; field names from vllm/entrypoints/openai/completion/protocol.py):
- one request per sample, `n = 1` with the sample's own `seed` (`seeds.sample_seed`): a request's seed seeds all its
  `n` samples' generator, so several samples in one request would not be drawn as megappo's seeds say;
- the prompt as token ids, the response as token ids (`return_token_ids`) with the sampled token's log-prob
  (`logprobs: 0`), nothing detokenized that megappo would read;
- log-probs under softmax(logits / T) (`SamplingParams.logprob_temperature`): the server and the engine run with
  `logprobs_mode=processed_logprobs`, which equals that when no top-k / top-p filter is set; with one, vLLM reports
  the filtered, renormalised distribution's (`FILTERED_LOGPROBS`, refused where the trainer uses them as the
  behaviour policy);
- greedy as temperature 0 (vLLM's greedy), whose processed log-probs are the plain softmax's, as megappo's;
- the server's weight version label is megappo's integer version as a string (`/update_weight_version`); where vLLM
  reports per-token versions (`CompletionOutput.weight_versions` spans; over HTTP from vLLM 0.34's
  `return_weight_versions`) each token gets its own, else the version the client served when it asked.
"""
from __future__ import annotations

import base64
import io
from typing import Any, Mapping, Optional, Sequence

from megappo.rollout.sampling import Completion, SamplingParams, check_prompts, check_scored

SERVED_MODEL = "megappo"  # --served-model-name of the servers megappo starts; a request names it (or an adapter)
LOGPROBS_MODE = "processed_logprobs"
FILTERED_LOGPROBS = ("a top-k or top-p filter makes vLLM report log-probs of the filtered, renormalised "
                     "distribution (logprobs_mode=processed_logprobs), not the unfiltered softmax(logits / T) the "
                     "trainer recomputes")
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM 0.32's --max-lora-rank takes


def max_lora_rank(rank: int) -> int:
    """The smallest `--max-lora-rank` vLLM takes that holds adapters of `rank` (4 -> 8)."""
    for allowed in LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"a LoRA rank of {rank} is above vLLM's largest --max-lora-rank ({LORA_RANKS[-1]})")


def lora_serving(adapter: Any) -> dict[str, Any]:
    """vLLM's engine arguments that serve a LoRA actor's adapters by name (`RolloutSettings.lora_adapter`, None:
    merged weights, no adapters)."""
    if adapter is None:
        return {}
    return {"enable_lora": True, "max_lora_rank": max_lora_rank(adapter.rank), "max_loras": 1}


def cli_flags(engine_args: Mapping[str, Any]) -> list[str]:
    """Engine arguments as `vllm serve` flags (True: the flag alone)."""
    flags: list[str] = []
    for key, value in engine_args.items():
        flags += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return flags


def model_eos_ids(model_path: str) -> tuple[int, ...]:
    """The end-of-sequence ids of a Hugging Face directory, as megappo's in-process engine stops on them: its
    generation_config.json's and config.json's `eos_token_id` (an id or a list). megappo starts vLLM with
    `--generation-config vllm`, whose only EOS is the tokenizer's, so requests name the others as stop tokens."""
    import json
    import os

    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        try:
            with open(os.path.join(model_path, name), encoding="utf-8") as f:
                eos = json.load(f).get("eos_token_id")
        except (OSError, ValueError):
            continue
        ids += [eos] if isinstance(eos, int) else list(eos or [])
    return tuple(sorted(set(ids)))


def sampling_fields(params: SamplingParams, seed: Optional[int], eos_ids: Sequence[int] = ()) -> dict[str, Any]:
    """The sampling fields both vLLM request kinds share (a completion request's, `vllm.SamplingParams`'s). eos_ids:
    the model's EOS ids (`model_eos_ids`), stop tokens unless `params.ignore_eos`."""
    fields: dict[str, Any] = {
        "max_tokens": int(params.max_new_tokens),
        "temperature": 0.0 if params.is_greedy else float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k) if params.top_k > 0 else -1,
        "n": 1,
        "ignore_eos": bool(params.ignore_eos),
        # ignore_eos: max_new_tokens whatever is sampled, stop tokens too (megappo's meaning, SGLang's; vLLM's own
        # ignore_eos would still stop on them)
        "stop_token_ids": [] if params.ignore_eos else sorted(set(params.stop_token_ids) | set(eos_ids)),
        "skip_special_tokens": False,
        "logprobs": 0,
    }
    if seed is not None:
        fields["seed"] = int(seed)
    return fields


def completion_request(prompt_ids: Sequence[int], params: SamplingParams, seed: Optional[int], *,
                       request_id: str, model: str = SERVED_MODEL, eos_ids: Sequence[int] = ()) -> dict[str, Any]:
    """The JSON body of one `/v1/completions` request: one sample of `prompt_ids` drawn with `seed`. `model`: the
    served model's name, or a LoRA adapter's (`lora_name`); `request_id`: the id `/abort_requests` names it by."""
    check_prompts([prompt_ids])
    body = {"model": model, "prompt": [int(t) for t in prompt_ids], "request_id": request_id,
            "return_token_ids": True, "stream": False,
            **sampling_fields(params, seed, eos_ids)}
    return body


def engine_request_id(request_id: str) -> str:
    """The id vLLM's engine knows a completion request by, which `/abort_requests` takes: the completions handler
    names the request "cmpl-<request_id>" and its i-th prompt "<that>-<i>" (vllm/entrypoints/openai/completion/
    serving.py); megappo's requests hold one prompt."""
    return f"cmpl-{request_id}-0"


def prompt_logprobs_request(token_ids: Sequence[int], *, request_id: str, model: str = SERVED_MODEL
                            ) -> dict[str, Any]:
    """A request whose answer holds log p(token_ids[k] | token_ids[:k]) for k >= 1 (`prompt_logprobs: 0`: the
    prompt's own token at each position), generating one greedy token that is not read."""
    check_scored([token_ids])
    return {"model": model, "prompt": [int(t) for t in token_ids], "request_id": request_id, "max_tokens": 1,
            "temperature": 0.0, "prompt_logprobs": 0, "return_token_ids": True, "stream": False}


def versions_of(spans: Optional[Sequence[Mapping[str, Any]]], n_tokens: int, default: int
                ) -> tuple[int, Optional[list[int]]]:
    """vLLM's weight-version spans ([{version, start, end}], output-token ranges) -> (the first token's version, the
    per-token versions when they differ, else None). Unlabelled spans and tokens are `default`'s (the version the
    client last gave the server)."""
    per_token = [default] * n_tokens
    for span in spans or ():
        label = span.get("version")
        version = int(label) if label is not None and str(label).lstrip("-").isdigit() else default
        for k in range(max(0, int(span["start"])), min(n_tokens, int(span["end"]))):
            per_token[k] = version
    if not per_token:
        return default, None
    return per_token[0], (per_token if len(set(per_token)) > 1 else None)


def decode_npy(b64: str) -> Any:
    """A base64 `.npy` payload (vLLM's routed experts) -> a numpy array (no pickles)."""
    import numpy as np

    return np.load(io.BytesIO(base64.b64decode(b64)), allow_pickle=False)


def parse_choice(choice: Mapping[str, Any], prompt_index: int, *, weight_version: int, partial: bool,
                 routes: Any = None, engine: str = "vLLM") -> Completion:
    """One `/v1/completions` choice -> a `Completion`. `routes`: a `RouteLayout` when the request asked for routed
    experts. An aborted choice raises unless `partial` (its tokens then continue a partial rollout)."""
    ids = choice.get("token_ids")
    if ids is None:
        raise RuntimeError(f"{engine} answered without token_ids: the server does not take return_token_ids "
                           "(megappo needs vLLM >= 0.10.2; megappo[vllm] pins the tested release)")
    reason = _FINISH.get(str(choice.get("finish_reason") or "length"), "length")
    if reason == "abort" and not partial:
        raise RuntimeError(f"{engine} aborted a request ({choice.get('stop_reason')!r})")
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
    if len(logprobs) != len(ids):
        raise RuntimeError(f"{engine} answered {len(ids)} tokens with {len(logprobs)} log-probs")
    first, per_token = versions_of(choice.get("weight_versions"), len(ids), weight_version)
    return Completion(prompt_index=prompt_index, output_ids=[int(t) for t in ids],
                      log_probs=[float(x) if x is not None else float("nan") for x in logprobs],
                      finish_reason=reason, weight_version=first, token_versions=per_token,
                      routed_experts=_routes(choice.get("routed_experts"), routes, engine))


def _routes(b64: Optional[str], layout: Any, engine: str) -> Any:
    if layout is None:
        return None
    if b64 is None:
        raise RuntimeError(f"{engine} returned no routed experts: start its servers with "
                           "--enable-return-routed-experts (megappo does when rollout.enable_rollout_routing_replay)")
    import torch

    from megappo.rollout.routes import engine_routes

    return engine_routes(torch.from_numpy(decode_npy(b64).astype("int64")), layout, engine)


def parse_prompt_logprobs(choice: Mapping[str, Any], token_ids: Sequence[int], engine: str = "vLLM") -> list[float]:
    """`prompt_logprobs` of a `prompt_logprobs_request`'s choice -> [log p(token_ids[k] | token_ids[:k]), k >= 1].
    Each position maps token ids (JSON keys: strings) to {logprob, rank, ...}; the prompt's own token must be there."""
    per_position = choice.get("prompt_logprobs")
    if per_position is None or len(per_position) != len(token_ids):
        got = None if per_position is None else len(per_position)
        raise RuntimeError(f"{engine} answered {got} prompt log-probs for {len(token_ids)} tokens")
    out = []
    for k in range(1, len(token_ids)):
        entry = per_position[k] or {}
        hit = entry.get(str(token_ids[k]), entry.get(token_ids[k]))
        if hit is None:
            raise RuntimeError(f"{engine}'s prompt log-probs at position {k} lack token {token_ids[k]}")
        out.append(float(hit["logprob"] if isinstance(hit, Mapping) else hit))
    return out


def parse_output(output: Any, prompt_index: int, *, weight_version: int, partial: bool, routes: Any = None
                 ) -> Completion:
    """One `vllm.CompletionOutput` of the engine in this process -> a `Completion` (its `logprobs`: per token a
    {token id: Logprob} map holding the sampled token's)."""
    ids = [int(t) for t in output.token_ids]
    logprobs = output.logprobs or []
    if len(logprobs) != len(ids):
        raise RuntimeError(f"vLLM answered {len(ids)} tokens with {len(logprobs)} log-probs")
    choice = {"token_ids": ids, "finish_reason": output.finish_reason, "stop_reason": output.stop_reason,
              "logprobs": {"token_logprobs": [float(lp[t].logprob) for lp, t in zip(logprobs, ids)]},
              "weight_versions": [{"version": span.version, "start": span.start, "end": span.end}
                                  for span in getattr(output, "weight_versions", None) or ()]}
    completion = parse_choice(choice, prompt_index, weight_version=weight_version, partial=partial)
    raw = getattr(output, "routed_experts", None)
    if routes is not None:
        if raw is None:
            raise RuntimeError("vLLM returned no routed experts: the engine needs enable_return_routed_experts")
        import torch

        from megappo.rollout.routes import engine_routes

        completion.routed_experts = engine_routes(torch.as_tensor(raw).to(torch.int64), routes, "vLLM")
    return completion
