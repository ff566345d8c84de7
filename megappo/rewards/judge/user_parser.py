"""A user's verdict parser (reward_model.judge.parser = "path/to/file.py:name" or "module:name"), checked when it is
loaded and guarded when it is called.

Loaded: it must be callable as `fn(verdict: str)`; anything else (not a function, an async one, one that needs
more arguments or only keywords) is a `JudgeParserError` naming the signature the judge calls it with, before the
run trains.

Called: a parser that raises, returns something other than a number or None, or a score outside [0, 1] (NaN and
infinities included) gives no score: the verdict counts as unparsed (asked again, then the judge's on_unparsed), and
the failure is counted (`failures`, logged by the scorer as reward/judge_parser_errors) and said on stderr, each
kind at most once a minute, the first of each kind with its traceback in the run's judge_parser.log. A score of 5
from a parser that forgot to map its 0-10 scale is therefore never trained on.
"""
from __future__ import annotations

import inspect
import math
import numbers
import os
import sys
import time
import traceback
from typing import Any, Callable, Optional, TextIO

from megappo.platform.user_code import UserCodeError

SIGNATURE = "fn(verdict: str) -> float | None"
LOG_FILE = "judge_parser.log"
# what each kind of failure is called in the warnings
KINDS = {"raised": "raised", "not_a_number": "returned something other than a number or None",
         "out_of_range": "returned a score outside [0, 1]"}


class JudgeParserError(UserCodeError):
    """A user's judge parser that cannot be called as the judge calls it; the message names the fix."""


def check_parser(fn: Any, name: str, where: str) -> None:
    """Raise JudgeParserError unless `fn` (the user's `name`) can be called as `fn(verdict)` without awaiting."""
    fix = (f"define it as def {name}(verdict: str) -> float | None, returning a score in [0, 1] or None where it "
           "cannot read the verdict")
    if not callable(fn):
        raise JudgeParserError(f"{where}: it names a {type(fn).__name__}, not a function; {fix}")
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        raise JudgeParserError(f"{where}: it is async, but the judge calls it as {SIGNATURE} and does not await it; "
                               f"{fix}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check until it is called
        return
    try:
        sig.bind("verdict")
    except TypeError as e:
        raise JudgeParserError(f"{where}: it takes {sig}, but the judge calls it with one argument, the verdict's "
                               f"text ({e}); {fix}") from e


class UserParser:
    """`fn` guarded: a score in [0, 1] or None, never an exception; failures counted and said (see the module)."""

    def __init__(self, fn: Callable[[str], Any], name: str, log_dir: Optional[str] = None, *,
                 interval_s: float = 60.0, out: Optional[TextIO] = None, clock: Callable[[], float] = time.monotonic):
        self.fn, self.name, self.log_dir = fn, name, log_dir
        self.interval_s, self.out, self.clock = interval_s, out, clock
        self.calls = 0  # parser calls so far
        self.failures = 0  # of them, the failed ones
        self.examples: list[str] = []  # the first failures' messages, for a stop message
        self._said: dict[str, float] = {}  # kind -> when it was last said
        self._unsaid: dict[str, int] = {}  # failures of the kind since then
        self._logged: set[str] = set()  # kinds whose first failure is in the log

    def __call__(self, text: str) -> Optional[float]:
        self.calls += 1
        try:
            value = self.fn(text)
        except Exception as e:  # the user's code failing on an odd verdict: said and unparsed, not a dead run
            return self._fail("raised", f"raised {type(e).__name__}: {e}", text, e)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return self._fail("not_a_number", f"returned {type(value).__name__} {_short(repr(value))}, not a "
                              "number (return a float in [0, 1], or None where it cannot read the verdict)", text)
        score = float(value)
        if not (math.isfinite(score) and 0.0 <= score <= 1.0):
            return self._fail("out_of_range", f"returned {score!r}, outside [0, 1] (a score must lie in [0, 1]: map "
                              "the judge's scale onto it, e.g. value / 10 for 0-10)", text)
        return score

    def _fail(self, kind: str, what: str, text: str, exc: Optional[BaseException] = None) -> None:
        self.failures += 1
        message = f"the judge's parser {self.name} {what}"
        if len(self.examples) < 3 and message not in self.examples:
            self.examples.append(message)
        log = self._log(kind, message, text, exc)
        now, last = self.clock(), self._said.get(kind)
        if last is not None and now - last < self.interval_s:
            self._unsaid[kind] = self._unsaid.get(kind, 0) + 1
            return None
        self._said[kind] = now
        more = self._unsaid.pop(kind, 0)
        since = f"; {more} more such failures since the last warning" if more else ""
        where = f"; the first one's traceback: {log}" if log else ""
        print(f"megappo train: WARNING: {message} on the verdict {_short(repr(text))}: the verdict counts as "
              f"unparsed (reward_model.judge.on_unparsed) and in reward/judge_parser_errors{where}{since}; said at "
              "most once a minute", file=self.out or sys.stderr, flush=True)
        return None

    def _log(self, kind: str, message: str, text: str, exc: Optional[BaseException]) -> Optional[str]:
        """The first failure of `kind`, with its traceback, appended to the run's log; the log's path, or None."""
        if kind in self._logged or not self.log_dir or not os.path.isdir(self.log_dir):
            return None
        self._logged.add(kind)
        path = os.path.join(self.log_dir, LOG_FILE)
        try:
            with open(path, "a") as f:
                f.write(f"{message}\non the verdict {text!r}\n")
                f.write("".join(traceback.format_exception(exc)) if exc is not None else "")
                f.write("\n")
        except OSError:
            return None
        return path if exc is not None else None


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
