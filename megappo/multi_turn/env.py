"""The tool-calling loop as an agent loop (`rollout.multi_turn`, agent name "tool_agent"): each assistant turn's
hermes tool calls run in the run's `ToolPool`, and their answers are the environment's tool messages.

A turn without a call ends the episode (the model answered); so does a turn with calls past max_assistant_turns
or max_user_turns (flagged `turn_limit_hit`; the calls are not run). Every call's record (answer, reward, metrics,
error and timeout flags, `failure`: why the tool itself failed) goes into the sample's `tool_results`, which the
trainer's tool warnings and stop read (`megappo.multi_turn.health`).
"""
from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Optional

from megappo.envs.base import EnvStep, Environment, EpisodeRow
from megappo.envs.registry import TOOL_LOOP, AgentLoops
from megappo.chat.parser import MARKUP, PARSERS, STOP_STRINGS, ToolCall
from megappo.multi_turn.pool import ToolPool
from megappo.chat.template import ChatDelta
from megappo.multi_turn.tools import BaseTool, ToolResult

logger = logging.getLogger(__name__)


def truncate(text: str, limit: int, side: str) -> str:
    """verl's truncation of a tool answer to `limit` characters (left: keep the end; right: keep the start; middle:
    keep both ends)."""
    if len(text) <= limit:
        return text
    if side == "left":
        return "(truncated)..." + text[-limit:]
    if side == "right":
        return text[:limit] + "...(truncated)"
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[-half:]


class ToolLoop:
    """The tools of a run and their pool, shared by every tool episode; `make(row)` starts one episode."""

    name = TOOL_LOOP
    own_turn_limits = True  # its step ends a turn past the limits before running the calls
    drives_episodes = False

    def __init__(self, settings: Any, tokenizer, tools: dict[str, BaseTool]):
        """settings: `megappo.envs.loop.EpisodeSettings` (format, turn limits, tool answer limits, pool)."""
        self.settings, self.tools = settings, tools
        self.parse = PARSERS[settings.format]
        self.tool_schemas = [t.tool_schema for t in tools.values()]
        self.delta = ChatDelta(tokenizer, self.tool_schemas, MARKUP[settings.format])
        # generation stops at the end of a call: the format's closing tag, when the tokenizer has it as one token
        end = tokenizer.convert_tokens_to_ids(STOP_STRINGS[settings.format])
        unk = getattr(tokenizer, "unk_token_id", None)
        self.stop_ids = (end,) if isinstance(end, int) and end != unk else ()
        self.step_timeout_s: Optional[float] = None  # each call has its own deadline in the pool
        self.pool = ToolPool(tools, max_workers=settings.tool_workers, backend=settings.tool_backend,
                             call_timeout_s=settings.tool_timeout_s)

    def make(self, row: EpisodeRow) -> "ToolEnvironment":
        return ToolEnvironment(self, row)

    def close(self) -> None:
        self.pool.close()


class ToolEnvironment(Environment):
    """One trajectory's tool calls: its tool instances live until `close`."""

    def __init__(self, agent: ToolLoop, row: EpisodeRow):
        self.agent, self.row = agent, row
        self.tool_schemas = agent.tool_schemas
        self.instances: dict[str, str] = {}  # tool name -> instance id
        self.turns = self.user_turns = 0
        self.records: list[dict] = []

    def start(self, row: EpisodeRow) -> list[dict]:
        return row.prompt

    def step(self, assistant: dict) -> EnvStep:
        self.turns += 1
        _, calls = self.agent.parse(assistant["content"])
        if not calls:
            return EnvStep(done=True)
        s = self.agent.settings
        if (s.max_assistant_turns and self.turns >= s.max_assistant_turns) or \
                (s.max_user_turns and self.user_turns >= s.max_user_turns):
            return EnvStep(done=True, truncated=True)
        calls = calls[:s.max_parallel_calls]
        pending = [self._start(call) for call in calls]
        results = [self._finish(call, p) for call, p in zip(calls, pending)]
        self.user_turns += 1
        self.records += results
        return EnvStep([{"role": "tool", "content": r["text"]} for r in results])

    def info(self) -> dict:
        """What the sample keeps of the episode: every call's record."""
        return {"tool_results": self.records}

    def _start(self, call: ToolCall) -> Any:
        """Submit one call to the pool: (future, start time), or (failure kind, answer text) of a call that cannot
        run (every failure is an answer that says what was wrong)."""
        tools = self.agent.tools
        if call.error is not None:
            return "bad_call", f"Error: {call.error}"
        if call.name not in tools:
            return "unknown_tool", (f"Error: there is no tool named {call.name!r}; the tools are: "
                                    f"{', '.join(sorted(tools)) or 'none'}")
        try:
            if call.name not in self.instances:
                self.instances[call.name] = f"{uuid.uuid4().hex}-{self.row.index}-{self.row.sample}"
                self.agent.pool.create(call.name, self.instances[call.name], **self._create_kwargs(call.name))
            return self.agent.pool.submit(call.name, self.instances[call.name], call.arguments), time.perf_counter()
        except Exception as e:  # a tool that fails to start is its answer, not a crashed step
            return "raised", f"Error: the tool {call.name} failed: {type(e).__name__}: {e}"

    def _create_kwargs(self, name: str) -> dict:
        """verl's per-row `tools_kwargs[name].create_kwargs` (a dataset's per-row tool arguments)."""
        return dict((self.row.tools_kwargs.get(name) or {}).get("create_kwargs") or {})

    def _finish(self, call: ToolCall, pending: Any) -> dict[str, Any]:
        """The call's record: its answer (by the pool's deadline), reward, metrics, error and timeout flags, and
        `failure`: why the tool itself failed (raised, unknown_tool, sandbox: its sandbox could not run the code;
        bad_call: the model's call was malformed; "" otherwise)."""
        record: dict[str, Any] = {"name": call.name, "arguments": call.arguments, "error": 0.0, "timeout": 0.0,
                                  "latency_s": 0.0, "reward": 0.0, "metrics": {}, "failure": ""}
        if isinstance(pending[0], str):
            record["failure"], text = pending
            record["error"] = 1.0
        else:
            future, t0 = pending
            result = self.agent.pool.result(future)
            if not isinstance(result, ToolResult):
                result = ToolResult(str(result))
            text, record["reward"] = result.text, float(result.reward)
            record["metrics"] = dict(result.metrics)
            record["error"] = float(bool(result.metrics.get("error", 0.0)))
            record["timeout"] = float(bool(result.metrics.get("timeout", 0.0)))
            record["failure"] = ("raised" if result.metrics.get("exception") else
                                 "sandbox" if result.metrics.get("sandbox_error") else "")
            record["latency_s"] = time.perf_counter() - t0
        s = self.agent.settings
        record["text"] = truncate(text, s.max_tool_response_length, s.tool_response_truncate_side)
        return record

    def close(self) -> None:
        for name, instance in self.instances.items():
            try:
                self.agent.pool.release(name, instance)
            except Exception as e:  # noqa: BLE001 - a release failure must not lose the step
                logger.warning("tool %s: release(%s) failed: %s", name, instance, e)
        self.instances.clear()



def tool_loop(settings: Any, tokenizer) -> ToolLoop:
    """The tool loop over the tools of `settings.tool_config_path` (the run's "tool_agent")."""
    from megappo.multi_turn.tools import load_tools

    return ToolLoop(settings, tokenizer, load_tools(settings.tool_config_path))


def tool_rollout(settings: Any, tokenizer, tools: dict) -> Any:
    """An episode loop whose every episode is the tool loop's over `tools` (`settings`: EpisodeSettings): the tool
    loop alone, as tests and benchmarks drive it."""
    from megappo.envs.loop import EpisodeRollout

    table = AgentLoops(settings, tokenizer, {ToolLoop.name: lambda: ToolLoop(settings, tokenizer, tools)},
                       ToolLoop.name)
    table.get(ToolLoop.name)  # its chat template is checked now
    return EpisodeRollout(settings, table)
