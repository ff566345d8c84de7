"""Failed episodes: the user's agent or environment failed, not the policy.

An episode fails when its agent program raised, returned something other than a reward, passed its deadline or
never called the endpoint, or when its environment's start or step raised, returned something other than an
`EnvStep` or passed its deadline. Such a sample holds whatever tokens the policy produced before the failure, and
its reward (0, or the rule reward of a cut-off answer) says nothing about them: trained on, it pushes down the
policy's most likely first moves, the ones a failing program meets most. `rollout.agent.on_failure` decides
(drop: out of the loss and out of its group's statistics, the default); this module finds the failures in the
samples' episode stats, counts them (episodes/*), says them on the console (once per agent and kind a minute, the
first traceback of each in the run's `episode_errors.log`) and stops a run whose episodes keep failing
(rollout.agent.max_failure_fraction / max_failure_steps)."""
from __future__ import annotations

import os
import sys
from typing import Optional, Sequence, TextIO

from megappo.platform.watch import OncePerInterval, Streak

# kind -> what the console says of it
FAILURE_KINDS = {
    "agent_error": "raised or returned something other than a reward",
    "agent_timeout": "passed its deadline (rollout.agent.deadline_s, or the entry's deadline_s)",
    "agent_no_call": "ended without calling the endpoint",
    "env_error": "raised or returned something other than an EnvStep",
    "env_timeout": "passed its step deadline (rollout.agent.step_timeout_s, or the entry's step_timeout_s)",
}
LOG_FILE = "episode_errors.log"
KEY = "actor_rollout_ref.rollout.agent"


def episode_failure(stats: Optional[dict]) -> Optional[str]:
    """The kind of failure of a sample's episode (`FAILURE_KINDS`) from its stats (`Samples.turn_stats`); None: it
    did not fail (or was no episode)."""
    if not stats:
        return None
    agent = stats.get("agent")
    if isinstance(agent, dict):  # an agent program's episode (megappo/agents/program.py)
        if agent.get("error"):
            return "agent_error"
        if agent.get("timeout"):
            return "agent_timeout"
        return "agent_no_call" if agent.get("no_calls") else None
    if stats.get("env_error"):
        return "env_error"
    return "env_timeout" if stats.get("env_timeout") else None


def failure_metrics(failures: Sequence[Optional[str]]) -> dict[str, float]:
    """episodes/failed_fraction and one episodes/<kind>_fraction per kind that occurred ({} for no episodes)."""
    n = len(failures)
    if not n:
        return {}
    out = {"episodes/failed_fraction": sum(f is not None for f in failures) / n}
    for kind in sorted({f for f in failures if f}):
        out[f"episodes/{kind}_fraction"] = sum(f == kind for f in failures) / n
    return out


class FailureWatch:
    """One run's failed-episode warnings (printed where `speak`: global rank 0) and its streak of failing steps."""

    def __init__(self, max_failure_fraction: Optional[float], max_failure_steps: int, on_failure: str, *,
                 log_dir: Optional[str] = None, speak: bool = True, out: Optional[TextIO] = None, warnings=None):
        self.streak, self.on_failure = Streak(max_failure_fraction, max_failure_steps), on_failure
        self.log = os.path.join(log_dir, LOG_FILE) if log_dir else None
        self.speak, self.out = speak, out
        self.warnings = warnings or OncePerInterval()

    def step(self, stats: Sequence[Optional[dict]], failures: Sequence[Optional[str]]) -> Optional[str]:
        """Say this step's failures; why the run must stop (None: go on)."""
        groups: dict[tuple[str, str], list[dict]] = {}
        for s, kind in zip(stats, failures):
            if kind:
                groups.setdefault((str(s.get("agent_name", "?")), kind), []).append(s)
        for (agent, kind), failed in groups.items():
            first = self.warnings.first((agent, kind))
            unsaid = self.warnings.due((agent, kind), len(failed))
            if unsaid is not None and self.speak:
                self._say(agent, kind, failed, len(stats), unsaid, log_it=first)
        episodes = [s for s in stats if s]
        fraction = sum(f is not None for f in failures) / len(episodes) if episodes else None
        if not self.streak.add(fraction):
            return None
        said = "; ".join(dict.fromkeys(_text(s, k) for s, k in zip(stats, failures) if k)) or "(none recorded)"
        return (f"more than {KEY}.max_failure_fraction={self.streak.max_fraction} of the episodes failed for "
                f"{self.streak.steps} steps in a row (episodes/failed_fraction {fraction:.2f} in the last): the "
                f"agent or environment is broken, not the policy. Failures: {said[:1500]}"
                + (f" (tracebacks: {self.log})" if self.log else "") + f". Fix it (or raise {KEY}."
                "max_failure_fraction, null: never stop) and start the same command again to resume")

    def _say(self, agent: str, kind: str, failed: list[dict], n: int, unsaid: int, log_it: bool) -> None:
        trace = next((s.get("traceback") for s in failed if s.get("traceback")), None)
        logged = self._log(agent, kind, failed[0], trace) if log_it else None
        since = f"; {unsaid} more since the last warning" if unsaid else ""
        fate = {"drop": "left out of the loss", "zero_reward": "trained on with reward 0",
                "keep": "trained on as they are"}[self.on_failure]
        where = f"; traceback in {logged}" if logged else ""
        print(f"megappo train: WARNING: {len(failed)} of {n} episodes of agent {agent!r} {FAILURE_KINDS[kind]}: "
              f"{_text(failed[0], kind)} ({fate}: {KEY}.on_failure={self.on_failure}; counted in "
              f"episodes/{kind}_fraction{where}{since}; said at most once a minute)",
              file=self.out or sys.stderr, flush=True)

    def _log(self, agent: str, kind: str, stats: dict, trace: Optional[str]) -> Optional[str]:
        if not self.log:
            return None
        try:
            with open(self.log, "a", encoding="utf-8") as f:
                f.write(f"=== agent {agent!r}: {kind}: {_text(stats, kind)}\n{trace or '(no traceback)'}\n")
        except OSError:
            return None
        return self.log


def _text(stats: dict, kind: str) -> str:
    """The failure's one-line description."""
    text = str(stats.get("error_text") or "").strip()
    return text.splitlines()[0][:300] if text else FAILURE_KINDS[kind]
