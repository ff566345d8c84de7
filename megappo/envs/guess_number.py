"""The built-in environment of the guess_number task (`megappo.tasks.guess_number`: its rules, rows and model): the
model guesses a secret number, the environment answers `higher` or `lower` until the guess is right or the guesses
run out."""
from __future__ import annotations

from typing import Optional

from megappo.envs.base import Environment, EnvStep, EpisodeRow
from megappo.tasks.guess_number import HIGHER, LOWER, NOT_A_NUMBER, TASKS, parse_guess


class GuessNumberEnv(Environment):
    """One episode: the secret is `row.ground_truth`; `row.extra_info` may set `low`, `high`, `max_turns`.

    Every assistant message is a guess (a turn), whatever its text: a non-number is a wrong guess answered
    `not a number`. The last step's metrics: `won`, `turns`, `invalid_guesses` (averaged as env/<key>)."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs  # the agent entry's arguments (unused: the row carries the episode's)
        self.secret: Optional[int] = None
        self.turns = self.invalid = 0
        self.done = self.closed = False

    def start(self, row: EpisodeRow) -> list[dict]:
        info, defaults = dict(row.extra_info or {}), TASKS["guess_number"]
        # a key absent from some rows reads back from Parquet as None in the others (one struct type per column)
        arg = lambda key: int(getattr(defaults, key) if info.get(key) is None else info[key])  # noqa: E731
        self.low, self.high, self.max_turns = arg("low"), arg("high"), arg("max_turns")
        secret = parse_guess(str(row.ground_truth))
        if secret is None or not self.low <= secret <= self.high or self.max_turns < 1:
            raise ValueError(f"guess_number row {row.index}: secret {row.ground_truth!r} is not in "
                             f"{self.low}..{self.high}, or max_turns {self.max_turns} < 1")
        self.secret = secret
        return [dict(m) for m in row.prompt]

    def step(self, assistant: dict) -> EnvStep:
        if self.secret is None or self.done or self.closed:
            raise RuntimeError("GuessNumberEnv.step before start, after the episode ended, or after close")
        self.turns += 1
        guess = parse_guess(assistant.get("content") if isinstance(assistant, dict) else None)
        self.invalid += guess is None
        if guess == self.secret:
            return self._end(1.0)
        if self.turns >= self.max_turns:
            return self._end(0.0)
        hint = NOT_A_NUMBER if guess is None else HIGHER if guess < self.secret else LOWER
        return EnvStep(messages=[{"role": "user", "content": hint}])

    def _end(self, reward: float) -> EnvStep:
        self.done = True
        return EnvStep(reward=reward, done=True, metrics={"won": reward, "turns": float(self.turns),
                                                          "invalid_guesses": float(self.invalid)})

    def close(self) -> None:
        self.closed = True
