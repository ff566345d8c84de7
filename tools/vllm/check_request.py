#!/usr/bin/env python
"""Check `/v1/completions` payloads against vLLM's own request model: does `CompletionRequest` (vLLM's OpenAI
completion protocol) validate each payload, and which `SamplingParams` does the server make of it?

What it does, in one process and without an engine: reads JSON on stdin (one payload object, or a list of them),
validates each with `CompletionRequest.model_validate`, computes max_tokens the way vLLM's completion server does
(`get_max_tokens(max_model_len, request.max_tokens, prompt length, {})`, prompt length = len of a token-id
prompt) and calls `request.to_sampling_params(max_tokens, {})` (no server default sampling params, i.e. a server
started with `--generation-config vllm`). Prints a JSON list, one entry per payload: {"ok": true,
"sampling_params": {field: value, ...}, "return_token_ids": ...} or {"ok": false, "error": "..."}. Exits 1 if any
payload failed.

Run it with the python of a vLLM venv (on a CPU-only machine: tools/vllm/install_cpu.sh):

    echo '{"model": "m", "prompt": [5, 6, 7], "max_tokens": 8, "logprobs": 0, "seed": 3,
           "return_token_ids": true}' | VENV/bin/python tools/vllm/check_request.py [--max-model-len 4096]
"""
import argparse
import enum
import json
import os
import sys


def jsonable(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    return repr(value)


def sampling_fields(sp):
    # SamplingParams is a msgspec Struct in vLLM; its declared fields are the whole state the engine sees
    names = getattr(type(sp), "__struct_fields__", None) or [n for n in vars(sp) if not n.startswith("_")]
    return {n: jsonable(getattr(sp, n)) for n in names if not n.startswith("_")}


def check(payload, max_model_len):
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens

    try:
        req = CompletionRequest.model_validate(payload)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            prompt_len = len(prompt)
        else:
            raise ValueError("this check covers one token-id prompt per payload (prompt: [int, ...])")
        max_tokens = get_max_tokens(max_model_len, req.max_tokens, prompt_len, {},
                                    truncate_prompt_tokens=req.truncate_prompt_tokens)
        sp = req.to_sampling_params(max_tokens, {})
    except Exception as e:  # pydantic's ValidationError and vLLM's own ValueErrors alike: report, go on
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    return {"ok": True, "sampling_params": sampling_fields(sp),
            "return_token_ids": jsonable(getattr(req, "return_token_ids", None)),
            "return_tokens_as_token_ids": jsonable(getattr(req, "return_tokens_as_token_ids", None))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-model-len", type=int, default=4096, help="the server's max_model_len")
    args = ap.parse_args()
    payloads = json.load(sys.stdin)
    if isinstance(payloads, dict):
        payloads = [payloads]
    # vLLM logs to stdout by default; stdout carries only the JSON answer
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    import torch

    if not torch.cuda.is_available():
        # a CUDA vLLM wheel on a CPU-only machine detects no platform at all unless told
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    out = [check(p, args.max_model_len) for p in payloads]
    print(json.dumps(out, indent=1))
    return 0 if all(o["ok"] for o in out) else 1


if __name__ == "__main__":
    sys.exit(main())
