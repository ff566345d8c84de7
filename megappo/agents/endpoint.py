"""An OpenAI-compatible chat-completions endpoint in front of a rollout engine, so that an agent program runs
unchanged against `base_url` with a per-trajectory API key, while megappo records the exact tokens it trains on.

    endpoint = AgentEndpoint(engine, tokenizer)                  # 127.0.0.1, a free port
    handle = endpoint.open(row_seed, params, budget_tokens=512, meta={"index": 3})
    client = openai.OpenAI(base_url=endpoint.base_url, api_key=handle.api_key)
    ...                                                          # the agent's calls
    record = endpoint.close_trajectory(handle)                   # later calls with its key: 401

Serves `POST /v1/chat/completions` and `GET /v1/models`. Every call renders its messages with the tokenizer's chat
template, continues the trajectory's segment of recorded token ids when the messages continue it, or starts a new
segment (counted as retokenized, megappo/agents/conversation.py), and is sampled in a batch with other trajectories'
calls (megappo/agents/batcher.py). Records: megappo/agents/records.py; wire format: megappo/agents/openai_format.py
(tool calls: the hermes calls in the model's text as OpenAI `tool_calls`; `stream: true` is answered as server-sent
events the `openai` client reads, sent once the turn is generated: generation itself is not streamed).

Sampling: the trainer's parameters (`open(..., params)`: temperature, top_p, top_k) win over the request's unless
`EndpointSettings.request_sampling`, since training assumes the run's sampling distribution; a request's
`max_tokens` can only lower the per-call limit, which is also clamped to the trajectory's remaining token budget;
its `stop` strings end the turn (the tokens up to the one completing the stop string are kept and trained on; the
content returned stops before it). Call c of a trajectory draws with `sample_seed(row_seed, c, 0, 1)` (a random
seed when the row has none), whatever batch it lands in; a request's `seed` is ignored.

Security (agents are untrusted programs): loopback by default; the key names its trajectory and is checked in
constant time, so a key reaches only its own record; bodies over `max_body_bytes` are refused unread (413), as are
too many messages, too long prompts, and requests beyond `max_concurrent_requests` (429); a request never takes a
server thread down (500 with the error). A call whose response was lost after it was recorded (the same request
again) is answered again from the record, not sampled twice.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import random
import secrets
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Optional, Union

from megappo.agents.batcher import Batcher, Closed, Pending
from megappo.agents.conversation import BadRequest, Plan, PromptBuilder, canonical
from megappo.agents.http import HttpServer, Reply
from megappo.agents.openai_format import (Answer, RequestSampling, answer, completion_json, error_json, message_json,
                                          parse_body, sampling, stop_cut, stream_events)
from megappo.agents.records import CallRecord, EndpointSettings, Segment, TrajectoryHandle, TrajectoryRecord, Turn
from megappo.chat.parser import TOOL_CALL_END
from megappo.rollout.base import RolloutEngine
from megappo.rollout.sampling import Completion, SamplingParams
from megappo.rollout.seeds import sample_seed


logger = logging.getLogger(__name__)
_MAX_PARTS = 64  # continuations of one aborted turn, at most


@dataclass
class _Generated:
    """A call's turn as the engine sampled it, in one part or more (see `AgentEndpoint._generate`)."""

    ids: list[int]
    log_probs: list[float]
    versions: list[int]  # per token: the weight version that sampled it
    finish: str
    queue_s: float = 0.0
    busy_s: float = 0.0
    engine_s: float = 0.0


class _Trajectory:
    def __init__(self, record: TrajectoryRecord, secret: str, params: SamplingParams):
        self.record, self.secret, self.params = record, secret, params
        self.lock = threading.Lock()  # one call at a time per trajectory: each continues what the last recorded
        self.last_key: Optional[str] = None  # the last answered request, and whether its answer reached the client
        self.last_reply: Optional[tuple[str, Answer, int, int]] = None
        self.delivered = True


class AgentEndpoint:
    """See the module docstring. engine: any `RolloutEngine`; tokenizer: a HF tokenizer with a chat template."""

    def __init__(self, engine: RolloutEngine, tokenizer, settings: EndpointSettings = EndpointSettings()):
        self.settings = settings
        self.builder = PromptBuilder(tokenizer)
        self.batcher = Batcher(engine, wait_s=settings.batch_wait_s, max_batch=settings.max_batch)
        self._trajectories: dict[str, _Trajectory] = {}
        self._lock = threading.Lock()
        self._inflight: set[Pending] = set()
        self._epoch = 0  # bumped by close/restart: a call of an older epoch is not recorded
        self._seeds = random.SystemRandom()
        end = tokenizer.convert_tokens_to_ids(TOOL_CALL_END)
        self._tool_stop = (end,) if isinstance(end, int) and end != getattr(tokenizer, "unk_token_id", None) else ()
        self._single_token: dict[str, Optional[int]] = {}
        self.http = HttpServer(self, settings)
        self.http.start(settings.port)

    @property
    def base_url(self) -> str:
        return f"http://{self.http.host}:{self.http.port}/v1"

    @property
    def engine(self) -> RolloutEngine:
        return self.batcher.engine

    @engine.setter
    def engine(self, engine: RolloutEngine) -> None:
        self.batcher.engine = engine  # read by the batcher per batch: the next batch uses it

    # -- trajectories -----------------------------------------------------------------------------------------------
    def open(self, row_seed: Optional[int], params: SamplingParams, budget_tokens: int,
             meta: Optional[dict] = None) -> TrajectoryHandle:
        """A new trajectory and its key. params: the trainer's sampling (max_new_tokens: the per-call limit);
        budget_tokens: the response tokens its segment may hold (model and in-between tokens)."""
        tid, secret = secrets.token_hex(8), secrets.token_urlsafe(32)
        record = TrajectoryRecord(tid, row_seed, budget_tokens, dict(meta or {}))
        with self._lock:
            self._trajectories[tid] = _Trajectory(record, secret, params)
        return TrajectoryHandle(tid, f"mp-{tid}.{secret}")

    def record(self, handle: Union[TrajectoryHandle, str]) -> TrajectoryRecord:
        """An open trajectory's record as it stands (KeyError once closed: `close_trajectory` returns it)."""
        tid = handle.id if isinstance(handle, TrajectoryHandle) else handle
        with self._lock:
            return self._trajectories[tid].record

    def close_trajectory(self, handle: Union[TrajectoryHandle, str]) -> TrajectoryRecord:
        """Revoke the key (its later and waiting calls: 401) and return the record. A call in flight is not
        waited for: it is not recorded."""
        tid = handle.id if isinstance(handle, TrajectoryHandle) else handle
        with self._lock:
            traj = self._trajectories.pop(tid)
            traj.record.closed = True
        return traj.record

    def _authenticate(self, authorization: Optional[str]) -> Optional[_Trajectory]:
        scheme, _, key = (authorization or "").partition(" ")
        tid, _, secret = key.strip().removeprefix("mp-").partition(".")
        if scheme.lower() != "bearer" or not secret:
            return None
        with self._lock:
            traj = self._trajectories.get(tid)
        if traj is None or not hmac.compare_digest(secret.encode(), traj.secret.encode()):
            return None
        return traj

    # -- lifecycle --------------------------------------------------------------------------------------------------
    def _fail_inflight(self) -> None:
        with self._lock:
            self._epoch += 1
            inflight, self._inflight = self._inflight, set()
        for call in inflight:
            call.finish(error=Closed("the endpoint stopped"))
        self.batcher.fail_all(Closed("the endpoint stopped"))

    def restart(self) -> None:
        """Stop serving (connections dropped, calls in flight answered 503 and not recorded) and serve again on the
        same port, keeping every trajectory and record: a server restart, for fault tests."""
        self.http.stop()
        self._fail_inflight()
        self.http.start(self.http.port)

    def close(self) -> None:
        """Stop serving and fail the calls in flight (503); records stay readable."""
        self.http.stop()
        self._fail_inflight()
        self.batcher.close()

    # -- requests ---------------------------------------------------------------------------------------------------
    def models(self, authorization: Optional[str]) -> Reply:
        if self._authenticate(authorization) is None:
            return _error(401, "invalid or revoked API key")
        return Reply.json(200, {"object": "list", "data": [{"id": self.settings.model_name, "object": "model",
                                                             "created": 0, "owned_by": "megappo"}]})

    def chat(self, authorization: Optional[str], body: bytes) -> Reply:
        """One chat-completions request (the HTTP layer gives its Authorization header and body)."""
        t0 = time.perf_counter()
        traj = self._authenticate(authorization)
        if traj is None:
            return _error(401, "invalid or revoked API key")
        try:
            obj = parse_body(body)
            samp = sampling(obj)
            messages = canonical(obj.get("messages"), self.settings.max_messages)
            tools = self.builder.escape_tools(obj.get("tools"))
        except BadRequest as e:
            traj.record.rejected_calls += 1
            return _error(400, str(e))
        with traj.lock:
            if traj.record.closed:
                return _error(401, "invalid or revoked API key")
            key = hashlib.sha256(json.dumps([messages, tools, samp.stop, samp.max_tokens], default=list,
                                            sort_keys=True).encode()).hexdigest()
            if key == traj.last_key and not traj.delivered and traj.last_reply is not None:
                traj.record.replayed_calls += 1  # the same call again: its answer was lost, not its record
                return self._reply(traj, samp, *traj.last_reply)
            try:
                return self._call(traj, messages, tools, samp, obj.get("messages"), key, t0)
            except BadRequest as e:
                traj.record.rejected_calls += 1
                return _error(400, str(e))

    def _plan(self, traj: _Trajectory, messages: list[dict], tools: Optional[list]) -> Plan:
        segments = traj.record.segments
        plan = self.builder.continuation(segments[-1], messages, tools) if segments else None
        plan = plan or self.builder.fresh(messages, tools)
        if len(plan.prompt_ids) > self.settings.max_prompt_tokens:
            raise BadRequest(f"the prompt is {len(plan.prompt_ids)} tokens; at most "
                             f"{self.settings.max_prompt_tokens}")
        return plan

    def _params(self, traj: _Trajectory, samp: RequestSampling, tools: Optional[list], limit: int) -> SamplingParams:
        params = traj.params
        if self.settings.request_sampling:
            params = replace(params, temperature=params.temperature if samp.temperature is None else samp.temperature,
                             top_p=params.top_p if samp.top_p is None else samp.top_p)
        stops = set(params.stop_token_ids) | {i for i in map(self._stop_id, samp.stop) if i is not None}
        stops |= set(self._tool_stop) if tools else set()
        return replace(params, max_new_tokens=limit, stop_token_ids=tuple(sorted(stops)), n=1, seed=None)

    def _stop_id(self, text: str) -> Optional[int]:
        """The token of a stop string that is one token (the engine then stops on it), else None."""
        if text not in self._single_token:
            ids = self.builder.encode(text)
            self._single_token[text] = ids[0] if len(ids) == 1 else None
        return self._single_token[text]

    def _submit(self, prompt: list[int], params: SamplingParams, seed: int) -> tuple[Completion, Pending]:
        call = self.batcher.submit(prompt, params, seed)
        with self._lock:
            self._inflight.add(call)
        try:
            return call.result(self.settings.request_timeout_s), call
        finally:
            with self._lock:
                self._inflight.discard(call)

    def _generate(self, prompt: list[int], params: SamplingParams, seed: int) -> _Generated:
        """The call's turn. A generation the engine aborted (a weight sync: finish "abort") goes on from the tokens
        it has, as a partial rollout does, each part under the weights that sampled it (part k > 0 draws with
        `sample_seed(seed, k, 0, 1)`), so the agent always gets a whole turn."""
        out = _Generated([], [], [], "length")
        if params.max_new_tokens <= 0:  # the budget is spent: an empty turn, the engine is not asked
            return out
        for part in range(_MAX_PARTS):
            left = params.max_new_tokens - len(out.ids)
            part_seed = seed if part == 0 else sample_seed(seed, part, 0, 1)
            completion, call = self._submit(prompt + out.ids, replace(params, max_new_tokens=left), part_seed)
            out.ids += completion.output_ids
            out.log_probs += completion.log_probs
            out.versions += [completion.weight_version] * len(completion.output_ids)
            out.finish, out.engine_s = completion.finish_reason, out.engine_s + call.engine_s
            out.queue_s += max(call.started_at - call.queued_at, 0.0) if call.started_at else 0.0
            out.busy_s += call.busy_s
            if out.finish != "abort" or len(out.ids) >= params.max_new_tokens:
                break
        if out.finish == "abort":
            out.finish = "length"
        return out

    def _call(self, traj: _Trajectory, messages: list[dict], tools: Optional[list], samp: RequestSampling,
              raw_messages: Any, key: str, t0: float) -> Reply:
        record = traj.record
        plan = self._plan(traj, messages, tools)
        segment = record.segments[-1] if plan.continued else None
        used = len(segment.ids) - segment.prompt_len + len(plan.delta) if segment else 0
        limit = min(traj.params.max_new_tokens, record.budget_tokens - used, samp.max_tokens or 1 << 30)
        params = self._params(traj, samp, tools, max(limit, 0))
        index = len(record.calls)
        seed = (sample_seed(record.row_seed, index, 0, 1) if record.row_seed is not None
                else self._seeds.randrange(2**63))
        epoch = self._epoch
        try:
            turn = self._generate(plan.prompt_ids, params, seed)
        except Closed:
            return _error(503, "the endpoint stopped before the call was answered; retry")
        except TimeoutError as e:
            return _error(503, f"generation timed out: {e}")
        except Exception as e:  # the engine failed: the call is not recorded, the agent may retry
            logger.warning("agent endpoint: generation failed: %s: %s", type(e).__name__, e)
            return _error(500, f"generation failed: {type(e).__name__}: {e}")
        reply, shown = self._answer(record, turn, samp, bool(tools))
        with self._lock:  # recorded at once or not at all: close_trajectory and restart take this lock too
            if epoch != self._epoch or record.closed:
                return _error(503 if not record.closed else 401, "the call was cut off (restart or revoked key)")
            self._record(record, plan, turn, shown)
            record.calls.append(CallRecord(index, len(record.segments) - 1, list(plan.prompt_ids), turn.ids,
                                           turn.log_probs, turn.versions, reply.finish_reason,
                                           not plan.continued and index > 0, turn.queue_s, turn.busy_s,
                                           turn.engine_s,
                                           max(time.perf_counter() - t0 - turn.queue_s - turn.engine_s, 0.0)))
            record.messages = list(raw_messages) + [message_json(reply)]
        traj.last_key, traj.last_reply, traj.delivered = key, (f"chatcmpl-{record.id}-{index}", reply,
                                                               len(plan.prompt_ids), len(turn.ids)), False
        return self._reply(traj, samp, *traj.last_reply)

    def _answer(self, record: TrajectoryRecord, turn: _Generated, samp: RequestSampling,
                tools: bool) -> tuple[Answer, Turn]:
        """The turn cut at its first stop string (in place), the assistant message the client gets, and the turn
        as the segment keeps it."""
        cut = stop_cut(self.builder.decode, turn.ids, samp.stop)
        text = self.builder.turn_text(turn.ids)
        if cut is not None:
            turn.ids, turn.log_probs, turn.versions = turn.ids[:cut[0]], turn.log_probs[:cut[0]], turn.versions[:cut[0]]
            turn.finish, text = "stop", self.builder.decode(turn.ids)[:cut[1]]
        issued = sum(len(t.tool_calls) for s in record.segments for t in s.turns)
        reply = answer(text, turn.finish, tools, lambda k: f"call_{record.id}_{issued + k}")
        return reply, Turn(reply.content, reply.tool_calls, self.builder.turn_text(turn.ids))

    @staticmethod
    def _record(record: TrajectoryRecord, plan: Plan, generated: _Generated, turn: Turn) -> None:
        if plan.continued:
            segment = record.segments[-1]
            segment.add(plan.delta, None, None, model=False)
            segment.between.append(plan.tail)
        else:
            segment = Segment(len(plan.prompt_ids), list(plan.prompt_ids), [], [], [], plan.base)
            record.segments.append(segment)
        segment.add(list(generated.ids), generated.log_probs, generated.versions, model=True)
        segment.turns.append(turn)

    def _reply(self, traj: _Trajectory, samp: RequestSampling, call_id: str, reply: Answer, prompt_tokens: int,
               completion_tokens: int) -> Reply:
        model = self.settings.model_name

        def delivered() -> None:
            traj.delivered = True
        if samp.stream:
            body = stream_events(call_id, model, reply, prompt_tokens, completion_tokens, samp.include_usage)
            return Reply(200, "text/event-stream", body, on_sent=delivered)
        return Reply.json(200, completion_json(call_id, model, reply, prompt_tokens, completion_tokens),
                          on_sent=delivered)


def _error(status: int, message: str) -> Reply:
    return Reply.json(status, error_json(status, message))
