"""SGLang's health probe (`is_healthy`): a one-token generation, which ServerSet.heal and the fleet ask of a server."""
from __future__ import annotations

import json
from typing import Optional

from megappo.rollout.serving.http_client import _http


# SGLang's own health check: one greedy token of the prompt [0] (0 is in every vocabulary), streamed (see is_healthy)
_PROBE = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}, "stream": True}


def is_healthy(url: str, timeout: float = 5, api_key: Optional[str] = None) -> bool:
    """Whether the server at `url` generates a token within `timeout` seconds: the check SGLang's GET /health makes
    (a one-token generation through the tokenizer manager, scheduler and detokenizer), sent as a /generate.

    Not /health itself: SGLang 0.5.23's handler looks for the answer after `asyncio.sleep(1)`, so /health never
    answers in under a second (measured 1.00 s on an idle tiny model, where the generation takes ~5 ms), and the
    trainer asks every server before every weight sync. Streamed, because a plain /generate answers before its
    request lets go of the server's model-update lock (the handler takes the first answer of the request's async
    generator and leaves the generator to be finalized later): a /pause_generation right after it (as in a sync)
    then found the lock held and slept a second (measured: 8 of 30 pauses 1.00 s; none of 60 after a streamed
    request, whose generator has ended before the stream's last chunk). Unlike /health, /generate needs the
    server's API key (`api_key`, default: the one registered for the URL)."""
    try:
        body = _http(url + "/generate", _PROBE, timeout=timeout, api_key=api_key)
    except Exception:  # noqa: BLE001 - no answer in time, a refused connection, an error status: unhealthy
        return False
    chunks = [line[len(b"data:"):].strip() for line in body.splitlines() if line.startswith(b"data:")]
    if not chunks or chunks[-1] != b"[DONE]":
        return False
    try:
        answers = [json.loads(c) for c in chunks[:-1]]
    except ValueError:
        return False
    return bool(answers) and all(isinstance(a, dict) and "error" not in a for a in answers)
