"""What the agent endpoint keeps per trajectory: its calls, its segments of exact token ids, and the handle an agent
gets (`TrajectoryHandle`: the trajectory's id and its API key).

A segment is one token-exact conversation: its first call's prompt, then every later call's model tokens (mask 1,
their log-probs and weight versions) and the tokens the chat template and the client's new messages add between
them (mask 0, log-prob 0, version -1). A call whose messages continue the segment (the assistant turns the endpoint
answered, sent back unchanged, then new non-assistant messages) appends to it; any other history (summarised,
edited, reordered) starts a new segment, and that call is counted as retokenized.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class EndpointSettings:
    """The endpoint's limits and choices (plain values)."""

    host: str = "127.0.0.1"  # loopback: agents run on this machine; another host is an explicit choice
    port: int = 0  # 0: a free port
    max_body_bytes: int = 1 << 20  # a larger request is refused (413) before its body is read
    max_messages: int = 512  # per request (400 beyond)
    max_prompt_tokens: int = 32768  # a call's whole prompt (400 beyond)
    max_concurrent_requests: int = 256  # requests being served at once (429 beyond; the openai client retries)
    batch_wait_s: float = 0.002  # how long a call waits for others to share its engine batch
    max_batch: int = 64  # calls per engine request
    request_timeout_s: float = 600.0  # a call waiting longer for its generation is answered 503
    socket_timeout_s: float = 30.0  # a client that stalls sending its request (or idles on keep-alive) is dropped
    # False: the trainer's sampling parameters (temperature, top_p, top_k) win over the request's, so every token is
    # drawn from the distribution training assumes; True: a request's temperature/top_p are used as given
    request_sampling: bool = False
    model_name: str = "megappo-policy"  # what /v1/models lists and responses name


@dataclass(frozen=True)
class TrajectoryHandle:
    """What an agent is given: the base URL's key for one trajectory (`Authorization: Bearer <api_key>`)."""

    id: str
    api_key: str


@dataclass
class CallRecord:
    """One chat-completions call as the engine served it."""

    index: int  # the call's number in its trajectory (its sampling seed's index)
    segment: int  # the segment it belongs to
    prompt_ids: list[int]  # the whole prompt the engine was given
    output_ids: list[int]  # the model's tokens (cut after a stop string when one ended the turn)
    log_probs: list[float]  # one per output token
    versions: list[int]  # per output token: the weight version that sampled it (more than one when a weight
    # sync aborted the generation and it went on under the new weights)
    finish_reason: str  # "stop", "length", "tool_calls", "abort"
    retokenized: bool  # the call's history did not continue the segment: a new segment from its whole rendering
    queue_s: float = 0.0  # waiting for the engine (a batch in flight) and for the batch to gather
    busy_s: float = 0.0  # the part of queue_s the engine was busy with earlier batches
    engine_s: float = 0.0  # the engine's generate call that served it (the whole batch's)
    overhead_s: float = 0.0  # the rest of the request's time in the endpoint (parsing, rendering, tokenising, JSON)

    @property
    def weight_version(self) -> Optional[int]:
        """The oldest weights among the turn's tokens (None for an empty turn)."""
        return min(self.versions) if self.versions else None


@dataclass
class Turn:
    """An assistant message the endpoint answered, as the client must send it back to continue the segment."""

    content: str  # the message content returned ("" for none)
    tool_calls: tuple[tuple[str, str, str], ...]  # (id, name, arguments JSON) per returned tool call
    text: str  # the model's own text of the turn (decoded output, EOS removed): what the template renders


@dataclass
class Segment:
    """Token-exact conversation: ids = prompt (prompt_len tokens) + response (model and in-between tokens)."""

    prompt_len: int
    ids: list[int]
    mask: list[int]  # per response token: 1 the model's, 0 the template's or the client's
    log_probs: list[float]  # per response token (0.0 where mask is 0)
    versions: list[int]  # per response token: the weight version that sampled it (-1 where mask is 0)
    base: list[dict]  # the canonical messages of the segment's first call
    turns: list[Turn] = field(default_factory=list)
    between: list[list[dict]] = field(default_factory=list)  # canonical messages sent after each turn but the last

    def add(self, ids: list[int], log_probs: Optional[list[float]], versions: Optional[list[int]],
            model: bool) -> None:
        self.ids += ids
        self.mask += [1 if model else 0] * len(ids)
        self.log_probs += list(log_probs) if model else [0.0] * len(ids)
        self.versions += list(versions) if model else [-1] * len(ids)


@dataclass
class TrajectoryRecord:
    """Everything one trajectory did through the endpoint."""

    id: str
    row_seed: Optional[int]
    budget_tokens: int  # response tokens of the trajectory's segment (model and in-between)
    meta: dict[str, Any]
    calls: list[CallRecord] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # the last call's messages and its answer (client format)
    replayed_calls: int = 0  # retries of a call already answered (a lost response): answered again, not resampled
    rejected_calls: int = 0  # requests refused for this trajectory (4xx after authentication)
    closed: bool = False
