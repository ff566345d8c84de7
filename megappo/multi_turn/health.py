"""Broken tools are said, not just counted: console warnings when a tool raises or an unknown tool is called, and
the stop of a run whose tools keep failing (multi_turn.max_tool_failure_fraction / max_tool_failure_steps).

A failing call is still the model's answer (the loop never fails a step for it), so without these a tool that
raises on every call, or a config whose tool names differ from the ones the prompts teach, trains on quietly with
the problem only in metrics.jsonl.
"""
from __future__ import annotations

import sys
import time
from typing import Callable, Optional, Sequence, TextIO

from megappo.envs.metrics import TOOL_FAILURES
from megappo.platform.exits import RunStopped
from megappo.platform.watch import OncePerInterval, Streak



class ToolWatch:
    """One run's tool warnings (printed where `speak`, i.e. on global rank 0) and its streak of failing steps."""

    def __init__(self, max_failure_fraction: Optional[float], max_failure_steps: int, *, speak: bool = True,
                 interval_s: float = 60.0, out: Optional[TextIO] = None, clock: Callable[[], float] = time.monotonic):
        self.streak = Streak(max_failure_fraction, max_failure_steps)
        self.speak, self.out = speak, out
        self.warnings = OncePerInterval(interval_s, clock)

    @property
    def max_failure_fraction(self) -> Optional[float]:
        return self.streak.max_fraction

    @property
    def failing_steps(self) -> int:
        return self.streak.steps

    def warn(self, tool_results: Sequence[Optional[Sequence[dict]]]) -> None:
        """Say each new (tool, kind of failure) with its error text; the same again at most once per interval_s,
        with how many were not said. Unknown tools count as one tool (the model can invent any number of names)."""
        for results in tool_results:
            for r in results or ():
                kind = r.get("failure")
                if kind not in TOOL_FAILURES:
                    continue
                more = self.warnings.due(("(unknown)" if kind == "unknown_tool" else r["name"], kind))
                if more is not None and self.speak:
                    self._say(r, kind, more)

    def _say(self, record: dict, kind: str, more: int) -> None:
        text = str(record.get("text", "")).removeprefix("Error: ")
        since = f"; {more} more such failures since the last warning" if more else ""
        print(f"megappo train: WARNING: tool {record['name']!r} {TOOL_FAILURES[kind]}: {text} (the model reads this "
              f"as the tool's answer and the call counts in tool/failure_fraction{since}; said at most once a minute)",
              file=self.out or sys.stderr, flush=True)

    def check(self, failure_fraction: Optional[float], examples: Sequence[str] = ()) -> Optional[str]:
        """After a step with tool calls' `failure_fraction` (tool/failure_fraction): why the run must stop, once
        the tool itself failed on more than max_failure_fraction of the calls for max_failure_steps steps in a row
        (None: go on)."""
        if not self.streak.add(failure_fraction):
            return None
        p = "actor_rollout_ref.rollout.multi_turn"
        said = "; ".join(dict.fromkeys(examples)) or "(none recorded)"
        return (f"the tool itself failed on more than {p}.max_tool_failure_fraction={self.max_failure_fraction} of the "
                f"calls for {self.failing_steps} steps in a row (tool/failure_fraction {failure_fraction:.2f} in the "
                f"last), so the run stopped instead of training on failed tool calls. Answers of failed calls: {said}. Fix the "
                f"tool or its config (or raise {p}.max_tool_failure_fraction, null: never stop; "
                f"{p}.max_tool_failure_steps) and start the same command again to resume")


def failed_answers(tool_results: Sequence[Optional[Sequence[dict]]], limit: int = 3) -> list[str]:
    """Up to `limit` distinct answers of failed calls, for a stop message."""
    out: list[str] = []
    for results in tool_results:
        for r in results or ():
            text = str(r.get("text", ""))[:300]
            if r.get("failure") in TOOL_FAILURES and text not in out:
                out.append(text)
                if len(out) >= limit:
                    return out
    return out


def watch_tools(watch: ToolWatch, metrics: dict[str, float], tool_results) -> None:
    """A step's multi-turn samples: warn about broken tools, and stop the run (RunStopped) when they keep
    failing."""
    watch.warn(tool_results)
    if "tool/calls_per_sample" in metrics and metrics["tool/calls_per_sample"] > 0:
        reason = watch.check(metrics.get("tool/failure_fraction"), failed_answers(tool_results))
    else:
        reason = watch.check(0.0)  # a step without calls breaks the streak
    if reason:
        raise RunStopped(reason)
