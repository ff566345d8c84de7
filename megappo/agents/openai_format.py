"""OpenAI's chat-completions wire format as the endpoint speaks it: the request's sampling fields, stop strings,
hermes tool calls as OpenAI `tool_calls`, and the response (one JSON object, or server-sent events when `stream`).

Streaming is not incremental: the turn is generated whole, then sent as the chunks the `openai` client assembles
(the role, the content, each tool call with its index, the finish reason, the usage when asked, `[DONE]`).
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any, Optional

from megappo.agents.conversation import BadRequest
from megappo.chat.parser import TOOL_CALL_START, parse_hermes


def parse_body(body: bytes) -> dict:
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise BadRequest("the request body nests too deeply") from None
    if not isinstance(obj, dict):
        raise BadRequest("the request body must be a JSON object")
    return obj


@dataclass(frozen=True)
class RequestSampling:
    """What a request asks of sampling (the trainer's parameters may override it, see EndpointSettings)."""

    max_tokens: Optional[int]
    temperature: Optional[float]
    top_p: Optional[float]
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def _number(obj: dict, key: str, lo: float, hi: float) -> Optional[float]:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not lo <= value <= hi:
        raise BadRequest(f"{key} must be a number in [{lo}, {hi}]")
    return float(value)


def sampling(obj: dict) -> RequestSampling:
    """The request's sampling fields, checked; unknown fields are ignored (the openai client sends many)."""
    n = obj.get("n", 1)
    if n not in (1, None):
        raise BadRequest("n must be 1: one completion per call (each call is one step of one trajectory)")
    limit = obj.get("max_completion_tokens", obj.get("max_tokens"))
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise BadRequest("max_tokens / max_completion_tokens must be a positive integer")
    stop = obj.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a string or a list of at most 4 non-empty strings")
    options = obj.get("stream_options") or {}
    return RequestSampling(limit, _number(obj, "temperature", 0.0, 2.0), _number(obj, "top_p", 0.0, 1.0),
                           tuple(stop), bool(obj.get("stream")), bool(isinstance(options, dict)
                                                                      and options.get("include_usage")))


def stop_cut(decode, output_ids: list[int], stops: tuple[str, ...]) -> Optional[tuple[int, int]]:
    """Where the first stop string ends the turn: (tokens kept: up to the one completing it, the stop string's
    position in their text), or None. Found by bisection: the text of a token prefix holds a stop string from the
    first prefix that completes one on."""
    if not stops:
        return None
    if not any(s in decode(output_ids) for s in stops):
        return None
    lo, hi = 1, len(output_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in decode(output_ids[:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    text = decode(output_ids[:lo])
    return lo, min(text.find(s) for s in stops if s in text)


@dataclass
class Answer:
    """The assistant message a turn becomes."""

    content: str
    tool_calls: tuple[tuple[str, str, str], ...]  # (id, name, arguments JSON)
    finish_reason: str


def answer(text: str, finish: str, tools_given: bool, call_id) -> Answer:
    """The message of a turn's text. With tools, its hermes tool calls (the well-formed ones) become `tool_calls`
    and the content is the text before the first call. `call_id(k)` names call k."""
    reason = "length" if finish == "length" else "stop"
    if not tools_given or TOOL_CALL_START not in text:
        return Answer(text, (), reason)
    _, calls = parse_hermes(text)
    good = [c for c in calls if c.error is None]
    if not good:  # malformed calls stay text: the agent reads what the model wrote
        return Answer(text, (), reason)
    calls_out = tuple((call_id(k), c.name, json.dumps(c.arguments)) for k, c in enumerate(good))
    return Answer(text[:text.index(TOOL_CALL_START)], calls_out, "tool_calls")


def message_json(a: Answer) -> dict:
    msg: dict[str, Any] = {"role": "assistant", "content": a.content if a.content or not a.tool_calls else None}
    if a.tool_calls:
        msg["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": args}}
                             for i, n, args in a.tool_calls]
    return msg


def completion_json(call_id: str, model: str, a: Answer, prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": call_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message_json(a), "finish_reason": a.finish_reason, "logprobs": None}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def stream_events(call_id: str, model: str, a: Answer, prompt_tokens: int, completion_tokens: int,
                  include_usage: bool) -> bytes:
    """The whole answer as server-sent events (`data: <chunk>` lines, then `data: [DONE]`)."""
    created = int(time.time())

    def chunk(delta: dict, finish: Optional[str] = None, **extra) -> dict:
        return {"id": call_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra}

    chunks = [chunk({"role": "assistant", "content": ""})]
    if a.content:
        chunks.append(chunk({"content": a.content}))
    for k, (i, name, args) in enumerate(a.tool_calls):
        chunks.append(chunk({"tool_calls": [{"index": k, "id": i, "type": "function",
                                             "function": {"name": name, "arguments": args}}]}))
    chunks.append(chunk({}, a.finish_reason))
    if include_usage:
        chunks.append({"id": call_id, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                                "completion_tokens": completion_tokens,
                                                "total_tokens": prompt_tokens + completion_tokens}})
    lines = [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]
    return "".join(lines).encode()


def error_json(status: int, message: str) -> dict:
    kinds = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 429: "rate_limit_error"}
    return {"error": {"message": message, "type": kinds.get(status, "server_error"), "code": status}}
