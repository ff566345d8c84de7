"""Episodes over any rollout engine: each sample is an environment's episode (`megappo.envs.base`), run in rounds.

A trajectory is built from the engine's own token ids (token in, token out): the model's turns are the tokens the
engine sampled, never re-tokenised; after a turn, the environment's messages are appended as the chat template
renders them (`ChatDelta.after_turn`: the template's own text tokenised as usual, each message's content escaped
and tokenised alone, so an environment's text never becomes a control token). The response is every token after the
prompt; its loss mask is 1 on the model's tokens and 0 on the environment's and the template's, whose engine
log-probs are 0. Each token keeps the version of the weights that produced it (`Completion.token_versions`).

Rounds: every live episode of a request generates its next turn in one `engine.generate` call; the environments'
steps of a round run concurrently in a thread pool, each by its agent's deadline. An episode ends when its
environment says done, when `response_length` tokens are spent over all its turns (`budget_hit`; the turn is cut to
fit), at max_assistant_turns (`turn_limit_hit`), or when its environment raised or passed its deadline (the sample
keeps the tokens it has). Its environment is closed in every case.

Across a weight sync (async_training.partial_rollout): when the engine aborts a round, the round's finished turns
still get their environment's answers, and the request returns with every live episode paused (finish_reason
"abort"); `resume` goes on from there with the engine's new weights (a paused turn continues where it stopped).
A request never paused is answered exactly as before.

Seeds: the first turn of sample j of prompt k is drawn exactly as single-turn sampling draws it (the request's
seed, prompt_offset + k, j); later rounds with a seed of the request's seed and the round, per row of the round's
request (the share's episodes still live, in order): repeatable for the same data-parallel layout.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import traceback
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

from megappo.envs.base import EnvStep, Environment, EpisodeRow
from megappo.rollout.base import RolloutEngine
from megappo.rollout.sampling import Completion, SamplingParams
from megappo.rollout.seeds import sample_seed

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EpisodeSettings:
    """`actor_rollout_ref.rollout.multi_turn` and `rollout.agent`, as plain values (mapped in
    `megappo.trainer.settings.episodes`; the meanings are the config's)."""

    tokenizer_path: Optional[str]
    trust_remote_code: bool
    response_length: int  # tokens of a whole episode's response, over all its turns
    max_assistant_turns: Optional[int]
    max_user_turns: Optional[int]
    tokenization_sanity_check_mode: str
    # the tool environment's (multi_turn): its config, format, answers and pool
    tool_config_path: Optional[str] = None
    format: str = "hermes"
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    tool_response_truncate_side: str = "middle"
    tool_backend: str = "thread"
    tool_workers: int = 8
    tool_timeout_s: Optional[float] = None
    # rollout.agent: the agent of a row without agent_name, the agent config file, the step pool and deadline
    default_agent: Optional[str] = None
    agent_config_path: Optional[str] = None
    num_workers: int = 64
    step_timeout_s: Optional[float] = 60.0
    agent_deadline_s: float = 300.0  # an agent program's episode
    agent_backend: str = "thread"  # where agent programs run: threads of the trainer, or a process per episode
    endpoint_host: str = "127.0.0.1"
    endpoint_port: int = 0


@dataclass(eq=False)
class Episode:
    index: int  # in the request: prompt k's sample j is k * n + j
    prompt_index: int
    prompt: list[int]
    agent: Any  # its agent loop (`megappo.envs.registry`): the environment's factory, chat delta and stops
    env: Optional[Environment] = None
    ids: list[int] = field(default_factory=list)  # the response so far
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # per response token, the weights' version
    messages: list[dict] = field(default_factory=list)
    turn_start: int = 0  # where the assistant turn being generated began in `ids`
    turns: int = 0
    user_turns: int = 0
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    budget_hit: bool = False
    turn_limit_hit: bool = False
    failed: str = ""  # "error" or "timeout": its environment's start or step failed
    error: str = ""  # what failed (one line) and its traceback, for the run's failure watch
    traceback: str = ""
    paused: bool = False  # its round was aborted (a weight sync): it continues in `resume`
    done: bool = False  # its environment said so
    info: dict = field(default_factory=dict)  # what its environment left for the sample (`info()`, at close)
    result: Optional[Completion] = None  # an agent program's episode: its sample, made by its agent

    def add(self, ids: Sequence[int], log_probs: Optional[Sequence[float]], versions: Sequence[int]) -> None:
        model = log_probs is not None
        self.ids += list(ids)
        self.mask += [1 if model else 0] * len(ids)
        self.log_probs += list(log_probs) if model else [0.0] * len(ids)
        self.versions += list(versions)


@dataclass
class _Request:
    """A request's episodes and where its rounds stand (kept while paused)."""

    episodes: list[Episode]
    num_prompts: int
    params: SamplingParams
    live: list[Episode]
    rounds: int = 0


def _fail(e: Episode, kind: str, what: str, exc: Optional[BaseException] = None) -> None:
    """The episode ends failed (its sample is flagged; `rollout.agent.on_failure` decides what is trained)."""
    e.failed, e.error = kind, f"environment {e.agent.name}: {what}"[:2000]
    e.traceback = "".join(traceback.format_exception(exc))[-8000:] if exc is not None else ""


class EpisodeRollout:
    """Runs a request's episodes over an engine: `generate` has `RolloutEngine.generate`'s contract plus each
    prompt's dataset row (`rows`: aligned with the prompts; None: rows that carry only the prompt's index)."""

    def __init__(self, settings: EpisodeSettings, agents: Any):
        """agents: the run's `megappo.envs.registry.AgentLoops` (built-in and configured agent loops by name)."""
        self.settings, self.agents, self.response_length = settings, agents, settings.response_length
        self.steps = cf.ThreadPoolExecutor(max(1, settings.num_workers), thread_name_prefix="megappo-env")
        self.paused: dict[str, _Request] = {}
        # set by `abort` (a weight sync): the request in progress pauses before its next round (an engine's own
        # abort only ends a round that is generating)
        self.aborting = threading.Event()

    # -- the loop --------------------------------------------------------------------------------------------------
    def generate(self, engine: RolloutEngine, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 prompt_offset: int = 0, rows: Optional[Sequence[EpisodeRow]] = None) -> list[list[Completion]]:
        self.aborting.clear()  # an abort before this call ended an earlier one
        n = params.n
        rows = list(rows) if rows is not None else [EpisodeRow([], "", None, {}, prompt_offset + k)
                                                     for k in range(len(prompts))]
        episodes = [Episode(k * n + j, k, list(p), self.agents.for_row(rows[k]))
                    for k, p in enumerate(prompts) for j in range(n)]
        row_of = {e.index: replace(rows[e.prompt_index], sample=e.index % n, seed=None if params.seed is None else
                                   sample_seed(params.seed, prompt_offset + e.prompt_index, e.index % n, n))
                  for e in episodes}
        self._run_programs([e for e in episodes if e.agent.drives_episodes], row_of, engine, params)
        for e in episodes:
            if not e.agent.drives_episodes:
                self._start(e, row_of[e.index])
        live = [e for e in episodes if not e.agent.drives_episodes and not e.failed]
        request = _Request(episodes, len(prompts), params, live)
        return self._run(engine, request, self._first_round(engine, request, prompts, prompt_offset))

    def _run_programs(self, episodes: list[Episode], row_of: dict, engine: RolloutEngine,
                      params: SamplingParams) -> None:
        """Episodes whose agent drives them itself (agent programs): each agent runs its rows' episodes whole."""
        by_agent: dict[int, list[Episode]] = {}
        for e in episodes:
            by_agent.setdefault(id(e.agent), []).append(e)
        for group in by_agent.values():
            done = group[0].agent.run_episodes(engine, [row_of[e.index] for e in group],
                                               replace(params, n=1, max_new_tokens=self.response_length))
            for e, c in zip(group, done):
                e.result = replace(c, prompt_index=e.prompt_index)

    def resume(self, engine: RolloutEngine, done: Sequence[Sequence[Completion]]) -> list[list[Completion]]:
        """Continue a paused request (`done`: what `generate` or `resume` answered) with the engine's weights now."""
        self.aborting.clear()
        key = next(c.extra["episodes"] for group in done for c in group if c.finish_reason == "abort")
        request = self.paused.pop(key)
        for e in request.live:
            e.paused = False
        return self._run(engine, request, None)

    def _run(self, engine: RolloutEngine, request: _Request, outputs: Optional[list[Completion]]
             ) -> list[list[Completion]]:
        while request.live:
            if outputs is None and self.aborting.is_set():
                return self._pause(request)
            if outputs is None:
                outputs = self._next_round(engine, request)
            ended = [self._take_turn(e, c) for e, c in zip(request.live, outputs)]
            stepping = [e for e, end in zip(request.live, ended) if not end and not e.paused]
            self._steps(stepping)
            going = {id(e) for e in stepping if self._continues(e)}
            for e in request.live:
                if not e.paused and id(e) not in going:
                    self._close(e)
            request.live = [e for e in request.live if e.paused or id(e) in going]
            outputs = None
            if any(e.paused for e in request.live):
                return self._pause(request)
        for e in request.episodes:
            self._close(e)
        return self._grouped(request)

    def _first_round(self, engine: RolloutEngine, request: _Request, prompts: Sequence[Sequence[int]],
                     prompt_offset: int) -> list[Completion]:
        """The first turn of every live episode, each drawn with its single-turn seed: when every episode starts at
        its dataset prompt, the request is single-turn sampling's own; otherwise each episode's prompt is a row with
        that seed (`SamplingParams.row_seeds`)."""
        params, n, live = request.params, request.params.n, request.live
        if len(live) == len(request.episodes) and all(e.prompt == list(prompts[e.prompt_index]) for e in live):
            answer = engine.generate(prompts, self._params(params, live), prompt_offset=prompt_offset)
            return [c for group in answer for c in group]
        if not live:
            return []
        seeds = None if params.seed is None else tuple(
            sample_seed(params.seed, prompt_offset + e.prompt_index, e.index % n, n) for e in live)
        answer = engine.generate([e.prompt for e in live], replace(self._params(params, live), n=1, row_seeds=seeds))
        return [group[0] for group in answer]

    def _next_round(self, engine: RolloutEngine, request: _Request) -> list[Completion]:
        request.rounds += 1
        params = request.params
        budget = max(self.response_length - len(e.ids) for e in request.live)
        seed = None if params.seed is None else (params.seed * 1_000_003 + request.rounds * 7_919) % (2**31 - 1)
        answer = engine.generate([e.prompt + e.ids for e in request.live],
                                 replace(self._params(params, request.live), n=1, max_new_tokens=budget, seed=seed))
        return [group[0] for group in answer]

    def _params(self, params: SamplingParams, episodes: Sequence[Episode]) -> SamplingParams:
        stops = {i for e in episodes for i in e.agent.stop_ids}
        return replace(params, max_new_tokens=self.response_length,
                       stop_token_ids=tuple(params.stop_token_ids) + tuple(sorted(stops - set(params.stop_token_ids))))

    def _pause(self, request: _Request) -> list[list[Completion]]:
        """Every live episode waits for `resume` (those between turns too); the answer holds them as "abort"."""
        for e in request.live:
            e.paused = True
        key = uuid.uuid4().hex
        self.paused[key] = request
        return self._grouped(request, key)

    # -- an episode ------------------------------------------------------------------------------------------------
    def _start(self, e: Episode, row: EpisodeRow) -> None:
        """Make and start its environment; its first messages, when they are not the row's prompt, are its prompt."""
        try:
            e.env = e.agent.make(row)
            first = e.env.start(row)
            if first is not row.prompt and first != row.prompt:
                e.prompt = e.agent.delta.prompt_ids(first)
        except Exception as exc:  # noqa: BLE001 - a broken environment ends its episode, not the step
            _fail(e, "error", f"start raised {type(exc).__name__}: {exc}", exc)

    def _take_turn(self, e: Episode, c: Completion) -> bool:
        """Append a generated turn (or the part an abort left); True when the episode ends with it."""
        room = self.response_length - len(e.ids)
        ids, logps = list(c.output_ids)[:room], list(c.log_probs)[:room]
        e.add(ids, logps, c.versions()[:room])
        if c.finish_reason == "abort" and len(ids) == len(c.output_ids):
            e.paused = True  # the weights change under it: the same turn goes on in `resume`
            return False
        e.turns += 1
        turn = e.ids[e.turn_start:]
        e.messages.append({"role": "assistant", "content": e.agent.delta.content(turn)})
        if len(ids) < len(c.output_ids) or (c.finish_reason == "length" and len(e.ids) >= self.response_length):
            e.budget_hit = True
            return True
        return c.finish_reason != "stop"

    def _steps(self, episodes: list[Episode]) -> None:
        """Every episode's environment answers its last turn, concurrently, each by its agent's deadline."""
        futures = [self.steps.submit(e.env.step, dict(e.messages[-1])) for e in episodes]
        for e, future in zip(episodes, futures):
            try:
                answer = future.result(timeout=e.agent.step_timeout_s)
            except cf.TimeoutError:
                _fail(e, "timeout", f"a step passed its {e.agent.step_timeout_s}s deadline (step_timeout_s)")
                continue
            except Exception as exc:  # noqa: BLE001 - said once by the run's failure watch, with a count
                _fail(e, "error", f"step raised {type(exc).__name__}: {exc}", exc)
                continue
            if not isinstance(answer, EnvStep):  # e.g. gym's (obs, reward, done, info): not a silent end
                _fail(e, "error", f"step returned {type(answer).__name__} {answer!r:.80}, not an EnvStep: return "
                      "megappo.envs.base.EnvStep(messages=[...], reward=..., done=...)")
                continue
            self._apply(e, answer)

    def _apply(self, e: Episode, step: EnvStep) -> None:
        e.reward += float(step.reward)
        for k, v in step.metrics.items():
            e.metrics[k] = e.metrics.get(k, 0.0) + float(v)
        if step.done or not step.messages:
            e.turn_limit_hit = e.turn_limit_hit or step.truncated
            e.done = True
            return
        mt = self.settings
        if mt.max_assistant_turns and e.turns >= mt.max_assistant_turns and not e.agent.own_turn_limits:
            e.turn_limit_hit = True
            return
        shown = [{"role": m.get("role", "user"), "content": e.agent.delta.escape(str(m.get("content", "")))}
                 for m in step.messages]
        tokens = e.agent.delta.after_turn(e.ids[e.turn_start:], shown)
        e.user_turns += 1
        if len(e.ids) + len(tokens) >= self.response_length:
            e.budget_hit = True  # no room for the answers and a turn after them: end on the model's turn
            return
        e.add(tokens, None, [e.versions[-1] if e.versions else 0] * len(tokens))
        e.messages += shown
        e.turn_start = len(e.ids)

    def _continues(self, e: Episode) -> bool:
        """After its step: whether the episode generates another turn."""
        return not (e.failed or e.budget_hit or e.turn_limit_hit or e.done) and len(e.ids) < self.response_length

    def _close(self, e: Episode) -> None:
        if e.env is None:
            return
        try:
            e.env.close()
        except Exception as exc:  # noqa: BLE001 - a close failure must not lose the step
            logger.warning("environment %s: close failed: %s", e.agent.name, exc)  # its episode is not lost
        e.info = getattr(e.env, "info", dict)()
        e.env = None

    # -- the result ------------------------------------------------------------------------------------------------
    def _grouped(self, request: _Request, paused_key: Optional[str] = None) -> list[list[Completion]]:
        grouped: list[list[Completion]] = [[] for _ in range(request.num_prompts)]
        for e in request.episodes:
            grouped[e.prompt_index].append(self._completion(e, paused_key))
        return grouped

    def _completion(self, e: Episode, paused_key: Optional[str]) -> Completion:
        if e.result is not None:
            return e.result
        mismatch = 0.0
        strict = self.settings.tokenization_sanity_check_mode == "strict"
        if strict and paused_key is None and not e.budget_hit and not e.failed:
            expected = e.agent.delta.expected_response(e.messages)
            mismatch = 0.0 if expected[:len(e.ids)] == e.ids else 1.0
        info = dict(e.info)
        tool_results = info.pop("tool_results", [])
        stats = {"turns": float(e.turns), "tool_calls": float(len(tool_results)),
                 "tool_errors": sum(r["error"] for r in tool_results),
                 "tool_timeouts": sum(r["timeout"] for r in tool_results),
                 "tool_latency_s": sum(r["latency_s"] for r in tool_results),
                 "tool_reward": sum(r["reward"] for r in tool_results),
                 "budget_hit": float(e.budget_hit), "turn_limit_hit": float(e.turn_limit_hit),
                 "template_mismatch": mismatch, "env_reward": e.reward,
                 "env_error": float(e.failed == "error"), "env_timeout": float(e.failed == "timeout"),
                 "env_metrics": dict(e.metrics), "agent_name": e.agent.name, "error_text": e.error or None,
                 "traceback": e.traceback or None}
        paused = paused_key is not None and e.paused
        finish = "abort" if paused else "length" if e.budget_hit else "stop"
        extra = {"loss_mask": list(e.mask), "multi_turn": stats, "messages": list(e.messages),
                 "tool_results": tool_results, "env_reward": e.reward, "agent": e.agent.name,
                 "prompt_ids": list(e.prompt), "partial": len(set(e.versions)) > 1}
        if paused_key is not None:
            extra["episodes"] = paused_key
        return Completion(prompt_index=e.prompt_index, output_ids=list(e.ids), log_probs=list(e.log_probs),
                          finish_reason=finish, weight_version=e.versions[0] if e.versions else 0,
                          extra=extra, token_versions=list(e.versions))

    def abort(self) -> None:
        """Pause the request in progress at its next round (its round generating now is the engine's to abort)."""
        self.aborting.set()

    def close(self) -> None:
        self.steps.shutdown(wait=False, cancel_futures=True)
        for request in self.paused.values():
            for e in request.episodes:
                self._close(e)
        self.paused.clear()
        self.agents.close()
