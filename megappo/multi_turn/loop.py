"""Multi-turn tool-calling rollouts over any rollout engine (`rollout.multi_turn`).

A trajectory is built from the engine's own token ids (token in, token out): the model's turns are the tokens the
engine sampled, never re-tokenised; after a turn that calls tools, the tools' answers are appended as the chat
template renders them (`ChatDelta`, megappo/multi_turn/template.py: the text the template adds after the
assistant's text, tokenised alone, each tool's text escaped and never tokenised to a control token; a strict check
compares the result with the template applied to the final messages). The response is every token after the
prompt; its loss mask is 1 on the model's tokens and 0 on the tool answers and the template's tokens, whose engine
log-probs are 0.

Turns are batched: every live trajectory of a request generates its next turn in one `engine.generate` call (a
round); the tool calls of a round run concurrently in a bounded `ToolPool` (threads, or Ray actors with
multi_turn.tool_backend=ray), each answered by its deadline (the tool's timeout_s plus a grace, or
multi_turn.tool_timeout_s) however slow the tool is. Generation stops at the end of a tool call
(the `</tool_call>` token when the tokenizer has it as one token, as Qwen's does; otherwise at EOS and the whole turn
is parsed, as verl does). A trajectory ends when a turn has no tool call, when `response_length` tokens are spent
over all its turns (flagged `budget_hit`; the turn is cut to fit), or at max_assistant_turns / max_user_turns
(flagged `turn_limit_hit`).

Seeds: the first turn of sample j of prompt k is drawn exactly as single-turn sampling draws it (the request's
seed, prompt_offset + k, j); later turns with a seed of the request's seed and the round, per row of the round's
request (the share's trajectories still live, in order): repeatable for the same data-parallel layout.
"""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

from megappo.multi_turn.parser import MARKUP, PARSERS, STOP_STRINGS, ToolCall
from megappo.multi_turn.pool import ToolPool
from megappo.multi_turn.template import ChatDelta, TemplateIgnoresTools
from megappo.multi_turn.tools import BaseTool, ToolResult
from megappo.rollout.base import RolloutEngine
from megappo.rollout.sampling import Completion, SamplingParams

# record["failure"] kinds where the tool itself failed (tool/failure_fraction; the run's stop and warnings read
# them); the model's own malformed call (bad_call) is not one: training corrects it
TOOL_FAILURES = {"raised": "raised an exception", "unknown_tool": "was called but no tool of that name is configured",
                 "sandbox": "could not run the code in its sandbox"}

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


@dataclass
class Trajectory:
    index: int  # in the request: prompt k's sample j is k * n + j
    prompt_index: int
    prompt: list[int]
    ids: list[int] = field(default_factory=list)  # the response so far
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    tool_results: list[dict] = field(default_factory=list)
    instances: dict[str, str] = field(default_factory=dict)  # tool name -> instance id
    turns: int = 0
    user_turns: int = 0
    budget_hit: bool = False
    turn_limit_hit: bool = False
    aborted: bool = False
    weight_version: Optional[int] = None

    def add(self, ids: Sequence[int], log_probs: Optional[Sequence[float]], model: bool) -> None:
        self.ids += list(ids)
        self.mask += [1 if model else 0] * len(ids)
        self.log_probs += list(log_probs) if model else [0.0] * len(ids)


@dataclass(frozen=True)
class MultiTurnSettings:
    """`actor_rollout_ref.rollout.multi_turn` and what the loop needs beside it, as plain values (mapped from the
    config in `megappo.trainer.settings.multi_turn`; the meanings are the config's)."""

    tokenizer_path: Optional[str]
    trust_remote_code: bool
    tool_config_path: Optional[str]
    response_length: int  # tokens of a whole trajectory's response, over all its turns
    format: str
    max_assistant_turns: Optional[int]
    max_user_turns: Optional[int]
    max_parallel_calls: int
    max_tool_response_length: int
    tool_response_truncate_side: str
    tokenization_sanity_check_mode: str
    tool_backend: str
    tool_workers: int
    tool_timeout_s: Optional[float]


class MultiTurnRollout:
    """The multi-turn loop of one engine holder: `generate` has `RolloutEngine.generate`'s contract."""

    def __init__(self, settings: MultiTurnSettings, tokenizer, tools: dict[str, BaseTool]):
        self.settings, self.tools, self.response_length = settings, tools, settings.response_length
        self.delta = ChatDelta(tokenizer, [t.tool_schema for t in tools.values()], MARKUP[settings.format])
        self.parse = PARSERS[settings.format]
        end = tokenizer.convert_tokens_to_ids(STOP_STRINGS[settings.format])
        unk = getattr(tokenizer, "unk_token_id", None)
        self.stop_ids = (end,) if isinstance(end, int) and end != unk else ()
        self.pool = ToolPool(tools, max_workers=settings.tool_workers, backend=settings.tool_backend,
                             call_timeout_s=settings.tool_timeout_s)

    # -- the loop --------------------------------------------------------------------------------------------------
    def generate(self, engine: RolloutEngine, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 prompt_offset: int = 0) -> list[list[Completion]]:
        n = params.n
        base = replace(params, stop_token_ids=tuple(params.stop_token_ids) + self.stop_ids)
        trajs = [Trajectory(k * n + j, k, list(p)) for k, p in enumerate(prompts) for j in range(n)]
        first = engine.generate(prompts, replace(base, max_new_tokens=self.response_length),
                                prompt_offset=prompt_offset)
        outputs = [c for group in first for c in group]
        live, rnd = trajs, 0
        while live:
            calls = [self._take_turn(t, c) for t, c in zip(live, outputs)]
            self._run_tools([(t, cs) for t, cs in zip(live, calls) if cs])
            live = [t for t, cs in zip(live, calls) if cs and self._continues(t)]
            if not live:
                break
            rnd += 1
            budget = max(self.response_length - len(t.ids) for t in live)
            seed = None if params.seed is None else (params.seed * 1_000_003 + rnd * 7_919) % (2**31 - 1)
            answer = engine.generate([t.prompt + t.ids for t in live],
                                     replace(base, n=1, max_new_tokens=budget, seed=seed))
            outputs = [group[0] for group in answer]
        for t in trajs:
            self._release(t)
        grouped: list[list[Completion]] = [[] for _ in prompts]
        for t in trajs:
            grouped[t.prompt_index].append(self._completion(t))
        return grouped

    def _take_turn(self, t: Trajectory, c: Completion) -> list[ToolCall]:
        """Append a generated turn; return its tool calls to run (none: the trajectory ends)."""
        if t.weight_version is None:
            t.weight_version = c.weight_version
        room = self.response_length - len(t.ids)
        ids, logps = list(c.output_ids)[:room], list(c.log_probs)[:room]
        t.add(ids, logps, model=True)
        t.turns += 1
        t.messages.append({"role": "assistant", "content": self.delta.content(ids)})
        if c.finish_reason == "abort":
            t.aborted = True
            return []
        if len(ids) < len(c.output_ids) or (c.finish_reason == "length" and len(t.ids) >= self.response_length):
            t.budget_hit = True
            return []
        if c.finish_reason != "stop":
            return []
        _, calls = self.parse(self.delta.decode(ids))
        if not calls:
            return []
        mt = self.settings
        if (mt.max_assistant_turns and t.turns >= mt.max_assistant_turns) or \
                (mt.max_user_turns and t.user_turns >= mt.max_user_turns):
            t.turn_limit_hit = True
            return []
        return calls[:mt.max_parallel_calls]

    def _continues(self, t: Trajectory) -> bool:
        """After a tool round: whether the trajectory generates another turn (its answers fitted the budget)."""
        return not t.budget_hit and len(t.ids) < self.response_length

    # -- tools -----------------------------------------------------------------------------------------------------
    def _run_tools(self, work: list[tuple[Trajectory, list[ToolCall]]]) -> None:
        started = [[self._start(t, call) for call in calls] for t, calls in work]
        for (t, calls), pending in zip(work, started):
            results = [self._finish(call, p) for call, p in zip(calls, pending)]
            answers = [self.delta.escape(r["text"]) for r in results]  # what the model reads
            tokens = self.delta.tool_answer(t.ids[len(t.ids) - self._last_turn_len(t):], answers)
            t.user_turns += 1
            t.tool_results += results
            if len(t.ids) + len(tokens) >= self.response_length:
                t.budget_hit = True  # no room for the answers and a turn after them: end on the model's call
                continue
            t.add(tokens, None, model=False)
            t.messages += [{"role": "tool", "content": a} for a in answers]

    @staticmethod
    def _last_turn_len(t: Trajectory) -> int:
        k = len(t.mask)
        while k > 0 and t.mask[k - 1] == 1:
            k -= 1
        return len(t.mask) - k

    def _start(self, t: Trajectory, call: ToolCall) -> Any:
        """Submit one call to the pool: (future, start time), or (failure kind, answer text) of a call that cannot
        run (every failure is an answer that says what was wrong)."""
        if call.error is not None:
            return "bad_call", f"Error: {call.error}"
        if call.name not in self.tools:
            return "unknown_tool", (f"Error: there is no tool named {call.name!r}; the tools are: "
                                    f"{', '.join(sorted(self.tools)) or 'none'}")
        try:
            if call.name not in t.instances:
                t.instances[call.name] = f"{uuid.uuid4().hex}-{t.index}"
                self.pool.create(call.name, t.instances[call.name])
            return self.pool.submit(call.name, t.instances[call.name], call.arguments), time.perf_counter()
        except Exception as e:  # a tool that fails to start is its answer, not a crashed step
            return "raised", f"Error: the tool {call.name} failed: {type(e).__name__}: {e}"

    def _finish(self, call: ToolCall, pending: Any) -> dict[str, Any]:
        """The call's record: its answer (by the pool's deadline), reward, metrics, error and timeout flags, and
        `failure`: why the tool itself failed (raised, unknown_tool, sandbox: its sandbox could not run the code;
        bad_call: the model's call was malformed; "" otherwise), which the trainer's warnings and stop read."""
        record: dict[str, Any] = {"name": call.name, "arguments": call.arguments, "error": 0.0, "timeout": 0.0,
                                  "latency_s": 0.0, "reward": 0.0, "metrics": {}, "failure": ""}
        if isinstance(pending[0], str):
            record["failure"], text = pending
            record["error"] = 1.0
        else:
            future, t0 = pending
            result = self.pool.result(future)
            if not isinstance(result, ToolResult):
                result = ToolResult(str(result))
            text, record["reward"] = result.text, float(result.reward)
            record["metrics"] = dict(result.metrics)
            record["error"] = float(bool(result.metrics.get("error", 0.0)))
            record["timeout"] = float(bool(result.metrics.get("timeout", 0.0)))
            record["failure"] = ("raised" if result.metrics.get("exception") else
                                 "sandbox" if result.metrics.get("sandbox_error") else "")
            record["latency_s"] = time.perf_counter() - t0
        s = self.settings
        record["text"] = truncate(text, s.max_tool_response_length, s.tool_response_truncate_side)
        return record

    def _release(self, t: Trajectory) -> None:
        for name, instance in t.instances.items():
            try:
                self.pool.release(name, instance)
            except Exception as e:  # noqa: BLE001 - a release failure must not lose the step
                logger.warning("tool %s: release(%s) failed: %s", name, instance, e)
        t.instances.clear()

    # -- the result ------------------------------------------------------------------------------------------------
    def _completion(self, t: Trajectory) -> Completion:
        mismatch = 0.0
        if self.settings.tokenization_sanity_check_mode == "strict" and not t.budget_hit and not t.aborted:
            expected = self.delta.expected_response(t.messages)
            mismatch = 0.0 if expected[:len(t.ids)] == t.ids else 1.0
        stats = {"turns": float(t.turns), "tool_calls": float(len(t.tool_results)),
                 "tool_errors": sum(r["error"] for r in t.tool_results),
                 "tool_timeouts": sum(r["timeout"] for r in t.tool_results),
                 "tool_latency_s": sum(r["latency_s"] for r in t.tool_results),
                 "tool_reward": sum(r["reward"] for r in t.tool_results),
                 "budget_hit": float(t.budget_hit), "turn_limit_hit": float(t.turn_limit_hit),
                 "template_mismatch": mismatch}
        finish = "abort" if t.aborted else "length" if t.budget_hit else "stop"
        return Completion(prompt_index=t.prompt_index, output_ids=t.ids, log_probs=t.log_probs, finish_reason=finish,
                          weight_version=t.weight_version or 0,
                          extra={"loss_mask": t.mask, "multi_turn": stats,
                                 "messages": t.messages, "tool_results": t.tool_results})

    def close(self) -> None:
        self.pool.close()


def multi_turn_metrics(stats: Sequence[Optional[dict]], tool_results: Sequence[Sequence[dict]]) -> dict[str, float]:
    """The step's multi_turn/* and tool/* metrics from each sample's stats (None: a single-turn sample)."""
    rows = [s for s in stats if s]
    if not rows:
        return {}
    n = len(rows)
    calls = [r for results in tool_results for r in (results or [])]
    out = {"multi_turn/turns_mean": sum(s["turns"] for s in rows) / n,
           "multi_turn/turns_max": max(s["turns"] for s in rows),
           "multi_turn/budget_hit_fraction": sum(s["budget_hit"] for s in rows) / n,
           "multi_turn/turn_limit_fraction": sum(s["turn_limit_hit"] for s in rows) / n,
           "multi_turn/template_mismatch_fraction": sum(s["template_mismatch"] for s in rows) / n,
           "tool/calls_per_sample": len(calls) / n,
           "tool/error_fraction": sum(c["error"] for c in calls) / max(len(calls), 1),
           "tool/failure_fraction": sum(c["failure"] in TOOL_FAILURES for c in calls) / max(len(calls), 1),
           "tool/timeout_fraction": sum(c["timeout"] for c in calls) / max(len(calls), 1),
           "tool/latency_s": sum(c["latency_s"] for c in calls) / max(len(calls), 1)}
    by_tool: dict[str, list[dict]] = {}
    for c in calls:
        if c["name"]:
            by_tool.setdefault(c["name"], []).append(c)
    for name, cs in by_tool.items():
        k = len(cs)
        out[f"tool/{name}/calls_per_sample"] = k / n
        out[f"tool/{name}/error_fraction"] = sum(c["error"] for c in cs) / k
        out[f"tool/{name}/latency_s"] = sum(c["latency_s"] for c in cs) / k
        keys = {key for c in cs for key in c["metrics"] if key not in ("error", "timeout")}
        for key in sorted(keys):
            vals = [float(c["metrics"][key]) for c in cs if isinstance(c["metrics"].get(key), (int, float))]
            if vals:
                out[f"tool/{name}/{key}"] = sum(vals) / len(vals)
    return out


class MultiTurnEngine(RolloutEngine):
    """An engine whose `generate` runs the multi-turn loop over another engine (every other call goes to it)."""

    def __init__(self, inner: RolloutEngine, loop: MultiTurnRollout):
        self.inner, self.loop = inner, loop

    @property
    def weight_version(self) -> int:  # type: ignore[override]
        return self.inner.weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self.inner.weight_version = version

    def generate(self, prompts, params, *, prompt_offset: int = 0):
        return self.loop.generate(self.inner, prompts, params, prompt_offset=prompt_offset)

    def abort(self) -> None:
        self.inner.abort()

    def pause(self) -> None:
        self.inner.pause()

    def resume(self) -> None:
        self.inner.resume()

    def load_weights(self, buckets, *, version: int, mode: str) -> int:
        return self.inner.load_weights(buckets, version=version, mode=mode)

    def update_weights_from_disk(self, model_path: str, *, version: int) -> int:
        return self.inner.update_weights_from_disk(model_path, version=version)

    def check_version(self, version: int) -> None:
        self.inner.check_version(version)

    def needs_copies(self, mode: str) -> bool:
        return self.inner.needs_copies(mode)

    def prompt_log_probs(self, token_ids):
        return self.inner.prompt_log_probs(token_ids)

    def close(self) -> None:
        """The loop's threads; the engine itself is its deployment's to close."""
        self.shutdown_submitter()
        self.loop.close()


def build_multi_turn(settings: MultiTurnSettings, engine: RolloutEngine) -> MultiTurnEngine:
    """The holder's engine wrapped in the loop of `actor_rollout_ref.rollout.multi_turn` (enable must be set)."""
    from transformers import AutoTokenizer

    from megappo.multi_turn.tools import load_tools

    tokenizer = AutoTokenizer.from_pretrained(settings.tokenizer_path, trust_remote_code=settings.trust_remote_code)
    tools = load_tools(settings.tool_config_path)
    try:
        loop = MultiTurnRollout(settings, tokenizer, tools)
    except TemplateIgnoresTools as e:  # a config error: the preflight could not check a tokenizer made later
        from megappo.config import ConfigError

        raise ConfigError([f"actor_rollout_ref.rollout.multi_turn.enable: {e}"]) from None
    return MultiTurnEngine(engine, loop)
