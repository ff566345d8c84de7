"""An agent program as one of the episode loop's agent loops: `rollout.agent.agent_loop_config_path` entries with
`agent: path/to/file.py:function` run their rows' episodes as that function against megappo's OpenAI-compatible
endpoint (`megappo.agents.runner.AgentRunner`), and answer the loop with one completion per row.

A program's calls are not paused by a weight sync (an agent's HTTP call cannot wait out a sync that its own request
holds up): an engine request the sync aborts is continued at once (`AgentEndpoint`), so the sync waits for
the programs' episodes to end. Each token still carries the version that produced it."""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

from megappo.envs.base import EpisodeRow
from megappo.chat.template import ChatDelta
from megappo.rollout.base import RolloutEngine
from megappo.rollout.sampling import Completion, SamplingParams


class AgentProgramLoop:
    """Episodes driven by an agent program (see the module docstring)."""

    own_turn_limits = False
    drives_episodes = True  # the loop hands it its rows' episodes whole (`run_episodes`)
    step_timeout_s: Optional[float] = None
    stop_ids: tuple[int, ...] = ()

    def __init__(self, name: str, fn: Callable[..., Any], tokenizer, settings: Any, *, spec: str = "",
                 kwargs: Optional[dict] = None, deadline_s: Optional[float] = None):
        """fn: the agent function; spec: its "path.py:function" name (absolute), which a process backend imports."""
        from megappo.agents.records import EndpointSettings
        from megappo.agents.runner import AgentRunner, check_agent_signature

        check_agent_signature(fn, f"{name} ({spec or fn!r})", kwargs)
        self.name = name
        self.delta = ChatDelta(tokenizer, [])
        deadline = float(deadline_s or settings.agent_deadline_s)
        if settings.agent_backend == "process":
            from megappo.agents.processes import ProcessAgent

            fn = ProcessAgent(spec, kwargs, deadline)
        elif kwargs:
            fn = functools.partial(fn, **kwargs)
        self.runner = AgentRunner(fn, tokenizer, max_workers=settings.num_workers, deadline_s=deadline,
                                  settings=EndpointSettings(host=settings.endpoint_host, port=settings.endpoint_port))

    def run_episodes(self, engine: RolloutEngine, rows: Sequence[EpisodeRow], params: SamplingParams
                     ) -> list[Completion]:
        """One completion per row (the row's episode), shaped as the episode loop's are."""
        return [self._as_episode(c) for c in self.runner.run(engine, rows, params)]

    def _as_episode(self, c: Completion) -> Completion:
        agent = c.extra["agent"]
        reward = c.extra.get("env_reward")
        stats = {"turns": float(agent["calls"]), "tool_calls": 0.0, "tool_errors": 0.0, "tool_timeouts": 0.0,
                 "tool_latency_s": 0.0, "tool_reward": 0.0, "budget_hit": float(c.finish_reason == "length"),
                 "turn_limit_hit": 0.0, "template_mismatch": 0.0,
                 "env_reward": 0.0 if reward is None else float(reward),
                 "env_error": agent["error"], "env_timeout": agent["timeout"],
                 "env_metrics": dict(c.extra.get("agent_metrics") or {}), "agent": dict(agent),
                 # what the program returned as its reward (None: nothing; the rule reward scores the episode)
                 "agent_reward": reward, "agent_name": self.name, "error_text": c.extra.get("agent_error"),
                 "traceback": c.extra.get("agent_traceback")}
        if c.finish_reason == "abort":  # an episode without a call: done, with an empty response (agent/no_call_fraction)
            c.finish_reason = "stop"
        versions = c.extra.pop("token_versions", None)
        c.token_versions = [max(v, 0) for v in versions] if versions else None
        c.extra.update({"multi_turn": stats, "tool_results": [], "env_reward": stats["env_reward"],
                        "agent": self.name, "partial": len(set(c.token_versions or [])) > 1})
        return c

    def close(self) -> None:
        self.runner.close()
