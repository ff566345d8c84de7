"""Two pieces every watch of user code shares (tools, agents, environments): a warning said at most once an interval
per key, with a count of those not said since, and a streak of failing steps that stops a run.
Pure Python; nothing of megappo is imported."""
from __future__ import annotations

import time
from typing import Callable, Hashable, Optional


class OncePerInterval:
    """`due(key)`: the number of earlier occurrences not said (>= 0) when `key` is to be said now, else None (and
    this occurrence is counted for the next time it is said)."""

    def __init__(self, interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.interval_s, self.clock = interval_s, clock
        self._said: dict[Hashable, float] = {}
        self._unsaid: dict[Hashable, int] = {}

    def due(self, key: Hashable, count: int = 1) -> Optional[int]:
        now, last = self.clock(), self._said.get(key)
        if last is not None and now - last < self.interval_s:
            self._unsaid[key] = self._unsaid.get(key, 0) + count
            return None
        self._said[key] = now
        return self._unsaid.pop(key, 0)

    def first(self, key: Hashable) -> bool:
        """Whether `key` was never said before."""
        return key not in self._said


class Streak:
    """Steps in a row whose failure fraction passed `max_fraction` (None: never counts); `over` once it reaches
    `max_steps`."""

    def __init__(self, max_fraction: Optional[float], max_steps: int):
        self.max_fraction, self.max_steps, self.steps = max_fraction, max_steps, 0

    def add(self, fraction: Optional[float]) -> bool:
        """Count one step; True when the run must stop."""
        if self.max_fraction is None or fraction is None:
            return False
        self.steps = self.steps + 1 if fraction > self.max_fraction else 0
        return self.steps >= self.max_steps
