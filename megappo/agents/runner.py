"""The user's agent program, one episode per sample, against the endpoint.

    def my_agent(base_url: str, api_key: str, row: EpisodeRow) -> None | float | dict:
        client = openai.OpenAI(base_url=base_url, api_key=api_key)
        ...                               # any number of chat-completions calls, tools, streaming
        return reward                     # float, or {"reward": float, "metrics": {...}}, or None

named "path/to/file.py:my_agent" or "package.module:my_agent". `AgentRunner.run(engine, rows, params)` opens one
trajectory per row, runs the agents in a bounded pool of threads (at most `max_workers` at once; threads only: an
agent needs no more than the base URL, its key and its row, so a process pool could come later), each with a
deadline of `deadline_s` from its start, and returns one `Completion` per row, in order, from the trajectory's
stitched sample (megappo/agents/stitch.py). Its `extra`: `prompt_ids`, `loss_mask`, `token_versions`, `messages`
(the last call's conversation and answer), `env_reward` (the agent's reward, or None), `agent` (the sample's stats:
calls, segments, retokenized calls, dropped tokens, error, timeout) and `agent_metrics` (the agent's own metrics).

An agent may be `async def` (run on an event loop of its thread). Its signature is checked when it is loaded
(`check_agent_signature`): a function that cannot be called as agent(base_url, api_key, row) is a `AgentSignatureError`
before any episode. An agent that raises, or returns something else than None, a finite number or a dict with one,
or runs past its deadline: its trajectory is closed at once (its key revoked, so a late call gets 401) and its sample is made of what it recorded, flagged
(`agent["error"]`, `agent["timeout"]`): every row gives exactly one sample, whatever its agent did. A Python thread
cannot be killed: an agent hung in a call of its own keeps its thread until it returns (its result is then
ignored); the runner does not wait for it, and its pool slot is given to the next episode. Agents are trusted code
run in this process (they are the user's); what they send to the endpoint is not.
"""
from __future__ import annotations

import asyncio
import inspect
import math
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

from megappo.agents.endpoint import AgentEndpoint
from megappo.agents.conversation import canonical
from megappo.agents.records import EndpointSettings, TrajectoryRecord
from megappo.agents.stitch import stitch
from megappo.envs.base import EpisodeRow
from megappo.platform.user_code import UserCodeError, load_named
from megappo.rollout.base import RolloutEngine
from megappo.rollout.sampling import Completion, SamplingParams

AgentFn = Callable[[str, str, EpisodeRow], Any]


class AgentSignatureError(UserCodeError):
    """An agent function that megappo cannot call as agent(base_url, api_key, row) (says which and the fix)."""


def check_agent_signature(fn: Callable, name: str, kwargs: Optional[dict] = None) -> None:
    """Refuse, before any episode, a function that cannot take (base_url, api_key, row) plus the entry's kwargs."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or C callable: its call says it
    try:
        sig.bind("http://127.0.0.1:1/v1", "key", None, **(kwargs or {}))
    except TypeError as e:
        extra = "".join(f", {k}=..." for k in kwargs or {})
        raise AgentSignatureError(
            f"agent {name}: the function has the signature {sig}, but megappo calls it as agent(base_url, api_key, "
            f"row{extra}) ({e}); define it as def {getattr(fn, '__name__', 'agent')}(base_url: str, api_key: str, "
            "row: EpisodeRow) (async def works too), with the agent config's kwargs as keyword arguments") from None


def resolve_agent(spec: Union[str, AgentFn], kwargs: Optional[dict] = None) -> AgentFn:
    """The function a "path/to/file.py:function" or "module:function" string names (a callable is itself), its
    signature checked against the call megappo makes (with the agent config's `kwargs`)."""
    fn = spec if callable(spec) else load_named(spec, None, f"agent {spec!r}")
    name = spec if isinstance(spec, str) else getattr(spec, "__name__", repr(spec))
    if not callable(fn):
        raise AgentSignatureError(f"agent {name!r}: {str(spec).rpartition(':')[2]} is not a function")
    check_agent_signature(fn, repr(name), kwargs)
    return fn


def call_agent(fn: AgentFn, base_url: str, api_key: str, row: EpisodeRow) -> Any:
    """The agent's result; an `async def` agent runs to its end on an event loop of this thread."""
    out = fn(base_url, api_key, row)
    return asyncio.run(out) if inspect.isawaitable(out) else out


@dataclass
class _Episode:
    index: int
    row: EpisodeRow
    handle: Any
    started: float = 0.0
    reward: Optional[float] = None
    metrics: dict = field(default_factory=dict)
    error: Optional[str] = None
    traceback: Optional[str] = None  # the error's whole traceback, for the run's log
    timeout: bool = False
    record: Optional[TrajectoryRecord] = None  # once its trajectory is closed


def _outcome(ep: _Episode, out: Any) -> None:
    """The episode's reward and metrics from what its agent returned; anything else is its error."""
    reward: Any = out
    if isinstance(out, dict):
        reward = out.get("reward")
        metrics = out.get("metrics") or {}
        bad = [k for k, v in metrics.items() if not _number(v)] if isinstance(metrics, dict) else ["(not a dict)"]
        if bad:
            ep.error = f"the agent's metrics must be a dict of numbers; not numbers: {bad[:3]}"
            return
        ep.metrics = {str(k): float(v) for k, v in metrics.items()}
    if reward is not None and not (_number(reward) and math.isfinite(float(reward))):
        what = f"{type(reward).__name__} {reward!r:.60}" if _number(reward) or isinstance(reward, str) else \
            type(reward).__name__
        ep.error = (f"the agent returned {what} as its reward; return None, a finite number or "
                    "{'reward': number, 'metrics': {name: number}}")
        return
    ep.reward = None if reward is None else float(reward)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class AgentRunner:
    """Runs `agent` per sample (see the module docstring). tokenizer: the policy's, with its chat template."""

    def __init__(self, agent: Union[str, AgentFn], tokenizer, *, max_workers: int = 64, deadline_s: float = 300.0,
                 settings: EndpointSettings = EndpointSettings()):
        self.agent, self.tokenizer = resolve_agent(agent), tokenizer
        self.max_workers, self.deadline_s, self.settings = max_workers, deadline_s, settings
        self.endpoint: Optional[AgentEndpoint] = None

    def _endpoint_for(self, engine: RolloutEngine) -> AgentEndpoint:
        if self.endpoint is None:
            self.endpoint = AgentEndpoint(engine, self.tokenizer, self.settings)
        self.endpoint.engine = engine
        return self.endpoint

    def _episode(self, ep: _Episode, base_url: str, done: threading.Condition, finished: dict) -> None:
        try:
            _outcome(ep, call_agent(self.agent, base_url, ep.handle.api_key, ep.row))
        except BaseException as e:  # the agent's failure is its sample's flag, never the step's
            ep.error = "".join(traceback.format_exception_only(type(e), e)).strip()[-2000:]
            ep.traceback = "".join(traceback.format_exception(e))[-8000:]
        with done:
            finished[ep.index] = ep
            done.notify_all()

    def run(self, engine: RolloutEngine, rows: Sequence[EpisodeRow], params: SamplingParams) -> list[Completion]:
        """One completion per row, in order. params: the run's sampling; max_new_tokens is each trajectory's
        response budget (and the per-call limit)."""
        endpoint = self._endpoint_for(engine)
        episodes = [_Episode(i, row, endpoint.open(row.seed, params, params.max_new_tokens,
                                                    {"index": row.index, "sample": row.sample}))
                    for i, row in enumerate(rows)]
        waiting, running, ended = deque(episodes), {}, {}
        done, finished = threading.Condition(), {}
        while waiting or running:
            while waiting and len(running) < self.max_workers:
                ep = waiting.popleft()
                ep.started = time.monotonic()
                running[ep.index] = ep
                threading.Thread(target=self._episode, args=(ep, endpoint.base_url, done, finished),
                                 name=f"megappo-agent-{ep.index}", daemon=True).start()
            with done:
                nearest = min(ep.started for ep in running.values()) + self.deadline_s
                if not finished:
                    done.wait(max(nearest - time.monotonic(), 0.0) + 1e-3)
                for i in list(finished):
                    if i in running:
                        ended[i] = running.pop(i)
                finished.clear()
            now = time.monotonic()
            for i, ep in list(running.items()):
                if now - ep.started >= self.deadline_s:
                    ep.timeout = True  # its thread is left to end on its own; the sample is finished now
                    ended[i] = running.pop(i)
                    ep.record = endpoint.close_trajectory(ep.handle)
        return [self._completion(endpoint, ended[ep.index], params) for ep in episodes]

    def _completion(self, endpoint: AgentEndpoint, ep: _Episode, params: SamplingParams) -> Completion:
        record = ep.record or endpoint.close_trajectory(ep.handle)
        prompt = [] if record.segments else endpoint.builder.fresh(canonical(list(ep.row.prompt), 1 << 30),
                                                                   None).prompt_ids
        sample = stitch(record, params.max_new_tokens, prompt)
        stats = {**sample.stats(), "error": float(ep.error is not None), "timeout": float(ep.timeout),
                 "replayed_calls": record.replayed_calls, "rejected_calls": record.rejected_calls}
        versions = [v for v in sample.versions if v >= 0]
        return Completion(ep.index, sample.response_ids, sample.log_probs, sample.finish_reason,
                          weight_version=min(versions) if versions else endpoint.engine.weight_version,
                          extra={"prompt_ids": sample.prompt_ids, "loss_mask": sample.loss_mask,
                                 "token_versions": sample.versions, "messages": record.messages,
                                 "env_reward": ep.reward, "agent": stats, "agent_metrics": ep.metrics,
                                 "agent_error": ep.error, "agent_traceback": ep.traceback})

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
