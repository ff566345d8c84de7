"""A step's episode metrics: multi_turn/* (turns, budgets, limits, template checks), tool/* (each tool call's
record) and env/* (the environments' rewards, failures and step metrics), from each sample's stats."""
from __future__ import annotations

from typing import Optional, Sequence

# a tool call record's (`tool_results`) "failure" kinds where the tool itself failed (tool/failure_fraction; the run's
# stop and warnings read them); the model's own malformed call (bad_call) is not one: training corrects it
TOOL_FAILURES = {"raised": "raised an exception", "unknown_tool": "was called but no tool of that name is configured",
                 "sandbox": "could not run the code in its sandbox"}


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
           "tool/latency_s": sum(c["latency_s"] for c in calls) / max(len(calls), 1),
           "env/reward_mean": sum(s.get("env_reward", 0.0) for s in rows) / n,
           "env/error_fraction": sum(s.get("env_error", 0.0) for s in rows) / n,
           "env/timeout_fraction": sum(s.get("env_timeout", 0.0) for s in rows) / n}
    programs = [s["agent"] for s in rows if s.get("agent")]  # agent programs' episodes (megappo.agents.program)
    if programs:
        out.update(agent_metrics(programs))
    env_keys = sorted({k for s in rows for k in s.get("env_metrics") or {}})
    for key in env_keys:  # the environments' own step metrics (summed over an episode), over the episodes that had them
        vals = [s["env_metrics"][key] for s in rows if key in (s.get("env_metrics") or {})]
        out[f"env/{key}"] = sum(vals) / len(vals)
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


def agent_metrics(stats: Sequence[dict]) -> dict[str, float]:
    """agent/*: agent programs' episodes (`megappo.agents.stitch.StitchedSample.stats` with error and timeout flags):
    fractions of episodes that raised, passed their deadline or never called; retokenized calls over calls (a call
    whose prompt did not extend the episode's tokens, `megappo.agents.conversation`), and per-episode means."""
    n, calls = len(stats), sum(s["calls"] for s in stats)
    return {"agent/error_fraction": sum(s["error"] for s in stats) / n,
            "agent/timeout_fraction": sum(s["timeout"] for s in stats) / n,
            "agent/no_call_fraction": sum(s["no_calls"] for s in stats) / n,
            "agent/retokenized_fraction": sum(s["retokenized_calls"] for s in stats) / calls if calls else 0.0,
            "agent/calls_per_episode": calls / n,
            "agent/segments_per_episode": sum(s["segments"] for s in stats) / n,
            "agent/dropped_tokens": sum(s["dropped_tokens"] for s in stats) / n,
            "agent/truncated_tokens": sum(s["truncated_tokens"] for s in stats) / n}
