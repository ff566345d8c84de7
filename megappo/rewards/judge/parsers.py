"""Verdict parsers: a judge's decoded answer -> a score in [0, 1], or None where it cannot be read (then the
judging loop asks again, and in the end applies reward_model.judge.on_unparsed).

- number: the last number of the answer (judges reason first and conclude), or the one in \\boxed{...} when there
  is one, which must lie in [lo, hi]; mapped linearly to [0, 1]. A number outside the range is unparsed, not
  clipped: a judge that leaves the scale did not follow the prompt.
- yes_no: the first "yes" or "no" as a word, either case; an answer holding both, or neither, is unparsed.
- pairwise: "A" or "B" (or "1" / "2") as the answer's first word or after "answer:"; 1.0 when A is preferred.
- a user function "path/to/file.py:name" (`megappo.platform.user_code.load_named`): fn(verdict) -> float in [0, 1]
  or None; checked at load and guarded when called (`user_parser.py`): one that raises, returns a non-number or a
  score outside [0, 1] gives an unparsed verdict, counted and said.
"""
from __future__ import annotations

import math
import re
from functools import partial
from typing import Callable, Optional

Parser = Callable[[str], Optional[float]]

_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)")
_BOXED = re.compile(r"\\boxed\{\s*([^{}]*?)\s*\}")
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)
_CHOICE = re.compile(r"^\W*(?:answer\s*[:\-]?\s*)?(?:response\s+)?\(?([AB12])\)?(?:\W|$)", re.IGNORECASE)


def parse_number(text: str, lo: float = 0.0, hi: float = 10.0) -> Optional[float]:
    boxed = _BOXED.findall(text)
    found = _NUMBER.findall(boxed[-1]) if boxed else _NUMBER.findall(text)
    if not found:
        return None
    value = float(found[-1])
    if not math.isfinite(value) or not lo <= value <= hi:
        return None
    return (value - lo) / (hi - lo)


def parse_yes_no(text: str) -> Optional[float]:
    words = {w.lower() for w in _YES_NO.findall(text)}
    if len(words) != 1:
        return None
    return 1.0 if words == {"yes"} else 0.0


def parse_pairwise(text: str) -> Optional[float]:
    m = _CHOICE.search(text.strip())
    if m is None:
        return None
    return 1.0 if m.group(1).upper() in ("A", "1") else 0.0


def get_parser(name: str, number_range: tuple[float, float] = (0.0, 10.0), base_dir: Optional[str] = None,
               log_dir: Optional[str] = None) -> Parser:
    """The parser called `name` (a built-in, or "path.py:name" / "module:name" of the user's: checked now, guarded
    when called, its first failures' tracebacks in `log_dir`; `megappo.rewards.judge.user_parser`)."""
    if name == "number":
        return partial(parse_number, lo=number_range[0], hi=number_range[1])
    if name == "yes_no":
        return parse_yes_no
    if name == "pairwise":
        return parse_pairwise
    from megappo.platform.user_code import load_named
    from megappo.rewards.judge.user_parser import UserParser, check_parser

    where = f"reward_model.judge.parser={name}"
    fn = load_named(name, base_dir, where=where)
    check_parser(fn, name.rpartition(":")[2], where)
    return UserParser(fn, name, log_dir)
