"""Rule reward for Geometry3K (data_source "hiyouga/geometry3k"): a format bonus plus the boxed answer's accuracy.

Follows verl 0.9.1's `verl.utils.reward_score.geo3k`: score = 0.9 * accuracy + 0.1 * format, where format is 1 when
the whole response reads `<think>...</think>...\\boxed{...}...` and accuracy is 1 when the content of the last
`\\boxed{}` grades equal to the reference answer. verl grades with mathruler's `grade_answer` (PRM800K's grader:
MATH's string normalisation, then sympy's simplify of the difference); megappo grades with its own code, without
sympy or pylatexenc:

- both answers are normalised as mathruler does (`\\text{}` wrapper, `$`, `%`, `\\left`/`\\right`, degrees and
  length units, `x = ` prefixes, `\\dfrac`/`\\tfrac`, `\\frac12` and `\\sqrt3` shorthands, thousands commas, case);
  equal strings are correct;
- otherwise each answer (each element of a tuple or interval, whose brackets must match) is read as an arithmetic
  TeX expression - numbers, `+ - * / ^`, `\\frac`, `\\sqrt` (and `\\sqrt[n]`), `\\pi`, `\\cdot`, `\\times`,
  parentheses, implicit products like `2\\sqrt{3}`, mixed numbers like `7 3/4`, and at most two one-letter
  variables - and compared by value at fixed points, within a relative tolerance of 1e-4.

Deliberate differences from verl, each of which only turns an answer verl marks wrong into a correct one (the
agreement test lists them): values are compared within the tolerance, so a decimal with four or more significant
digits matches the exact form (`3.4641` == `2\\sqrt{3}`, `6.2832` == `2\\pi`; sympy needs an exact zero); an integer
reference accepts any expression of that value (`\\sqrt{9}` == `3`; mathruler demands an integer); and unreduced
fractions count (`2/4` == `1/2`; mathruler requires the same string). Answers that are neither equal strings nor
readable expressions (words, other functions, three or more variables) are wrong, where sympy might still parse them.
"""
from __future__ import annotations

import math
import re
from typing import Callable, Optional

FORMAT_SCORE = 0.1  # verl's weight of the format bonus; accuracy has the rest
REL_TOL = 1e-4  # by-value comparison: |a - b| <= REL_TOL * max(1, |b|)
_FORMAT_RE = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)
# mathruler's unit words, each optionally plural and with a power ("cm^2")
_UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month", "year",
          "foot", "feet", "inch", "yard")
_UNITS_RE = re.compile(rf"(?:{'|'.join(_UNITS)})(?:es)?s? *(?:\^[0-9]+)?")
_TUPLE_CHARS = "()[]"
_THOUSANDS_RE = re.compile(r"(\d),(\d\d\d)($|\D)")
# points at which expressions with variables are compared (arbitrary, away from 0, 1 and each other)
_SAMPLE_POINTS = ((0.5371, 1.3193), (1.7263, 0.3719), (2.9417, 2.2031))


def format_reward(response: str) -> float:
    """1.0 when the whole response is `<think>...</think>...\\boxed{...}...` (verl's regex), else 0.0."""
    return 1.0 if _FORMAT_RE.fullmatch(response) else 0.0


def extract_boxed(text: str) -> Optional[str]:
    """The stripped content of the last `\\boxed{...}` whose braces close, or None (mathruler returns "None")."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start + len("\\boxed{"), len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[start + len("\\boxed{"):i].strip()
            depth -= 1
    return None


def normalize(answer: str) -> str:
    """A canonical string for an answer: decoration, units and spaces removed, shorthands expanded, lower case."""
    s = answer.strip()
    if m := re.fullmatch(r"\\text\{(.+?)\}", s):
        s = m.group(1).strip()
    if "\\text{ " in s:  # MATH's convention: "\text{ " only ever starts a unit on the right
        s = s.split("\\text{ ")[0]
    for before, after in (("\n", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\\\", "\\"), ("tfrac", "frac"),
                          ("dfrac", "frac"), ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""),
                          ("°", ""), ("\\%", ""), ("%", ""), ("\\$", ""), ("$", ""), (" or ", ","), (" and ", ",")):
        s = s.replace(before, after)
    s = _UNITS_RE.sub("", s)
    s = re.sub(r"\\(?:text|mathrm|textbf)\{([^{}]*)\}", r"\1", s)
    if s.count("=") == 1 and len(s.split("=")[0].strip()) <= 2:  # "x = 5", "AB=5"
        s = s.split("=")[1]
    s = re.sub(r"\\sqrt(?=[^{\[])\s*(\w)", r"\\sqrt{\1}", s)  # \sqrt3 -> \sqrt{3}
    s = re.sub(r"\\frac(?=[^{])\s*(\w)\s*(\w)", r"\\frac{\1}{\2}", s)  # \frac12 -> \frac{1}{2}
    s = re.sub(r"(\d) +(\d)", r"\1+\2", s)  # a mixed number: "7 3/4" is 7 + 3/4
    s = s.replace(" ", "")
    while (t := _THOUSANDS_RE.sub(r"\1\2\3", s)) != s:  # "1,000" (but not the tuple "1,2")
        s = t
    if s.startswith(".") or s.startswith("-."):
        s = s.replace(".", "0.", 1)
    if len(s) >= 2 and s[0] == "{" and s[-1] == "}":
        s = s[1:-1]
    return s.lower()


# ---------------------------------------------------------------------------------------------------------------
# arithmetic TeX expressions -> functions of at most two variables
# ---------------------------------------------------------------------------------------------------------------
Expr = Callable[[dict], float]
_TOKEN_RE = re.compile(r"\d+\.?\d*|\.\d+|\\[a-z]+|[a-z]|[-+*/^(){}\[\]]|\S")


class _Unreadable(ValueError):
    """Not an arithmetic expression megappo reads (compare as strings only)."""


class _Parser:
    """Recursive descent over tokens: expr := term (+|- term)*, term := factor ((*|/|implicit) factor)*,
    factor := (+|-) factor | atom (^ factor)?. Builds closures evaluated at variable assignments."""

    def __init__(self, text: str):
        self.tokens = _TOKEN_RE.findall(text.replace("\\cdot", "*").replace("\\times", "*").replace("π", "\\pi"))
        self.i = 0
        self.variables: set[str] = set()

    def peek(self) -> Optional[str]:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, expected: Optional[str] = None) -> str:
        tok = self.peek()
        if tok is None or (expected is not None and tok != expected):
            raise _Unreadable(f"expected {expected!r}, got {tok!r}")
        self.i += 1
        return tok

    def parse(self) -> Expr:
        if not self.tokens:
            raise _Unreadable("empty")
        e = self.expr()
        if self.peek() is not None:
            raise _Unreadable(f"unexpected {self.peek()!r}")
        return e

    def expr(self) -> Expr:
        e = self.term()
        while self.peek() in ("+", "-"):
            op, rhs, lhs = self.take(), self.term(), e
            e = (lambda a, b: lambda v: a(v) + b(v))(lhs, rhs) if op == "+" else \
                (lambda a, b: lambda v: a(v) - b(v))(lhs, rhs)
        return e

    def term(self) -> Expr:
        e = self.factor()
        while (tok := self.peek()) is not None and tok not in ("+", "-", ")", "}", "]", "^"):
            op = self.take() if tok in ("*", "/") else "*"  # anything else starts an implicit product
            rhs, lhs = self.factor(), e
            e = (lambda a, b: lambda v: a(v) * b(v))(lhs, rhs) if op == "*" else \
                (lambda a, b: lambda v: a(v) / b(v))(lhs, rhs)
        return e

    def factor(self) -> Expr:
        if self.peek() in ("+", "-"):
            sign, inner = self.take(), self.factor()
            return inner if sign == "+" else (lambda a: lambda v: -a(v))(inner)
        base = self.atom()
        if self.peek() == "^":
            self.take()
            exponent = self.factor()
            return (lambda a, b: lambda v: a(v) ** b(v))(base, exponent)
        return base

    def group(self) -> Expr:
        self.take("{")
        e = self.expr()
        self.take("}")
        return e

    def atom(self) -> Expr:
        tok = self.take()
        if tok[0].isdigit() or tok[0] == ".":
            value = float(tok)
            return lambda v: value
        if len(tok) == 1 and tok.isalpha():
            self.variables.add(tok)
            return lambda v: v[tok]
        if tok in ("(", "{", "["):
            e = self.expr()
            self.take({"(": ")", "{": "}", "[": "]"}[tok])
            return e
        if tok == "\\pi":
            return lambda v: math.pi
        if tok == "\\frac":
            num, den = self.group(), self.group()
            return lambda v: num(v) / den(v)
        if tok == "\\sqrt":
            if self.peek() == "[":
                self.take()
                degree = self.expr()
                self.take("]")
            else:
                degree = lambda v: 2.0  # noqa: E731
            radicand = self.group()
            return lambda v: _root(radicand(v), degree(v))
        raise _Unreadable(f"unknown token {tok!r}")


def _root(x: float, n: float) -> float:
    if x < 0:
        raise ValueError("root of a negative number")
    return x ** (1.0 / n)


def read_expression(text: str) -> Optional[tuple[Expr, set[str]]]:
    """(function of a variable assignment, its variables) for an arithmetic answer, or None when unreadable."""
    parser = _Parser(text)
    try:
        return parser.parse(), parser.variables
    except (_Unreadable, RecursionError):
        return None


def _same_value(given: str, truth: str) -> bool:
    a, b = read_expression(given), read_expression(truth)
    if a is None or b is None:
        return False
    names = sorted(a[1] | b[1])
    if len(names) > 2:  # mathruler's limit too: beyond it an answer is text, not an expression
        return False
    points = [dict(zip(names, p)) for p in _SAMPLE_POINTS] if names else [{}]
    for env in points:
        try:
            x, y = float(a[0](env)), float(b[0](env))
        except (ArithmeticError, ValueError, TypeError, OverflowError):
            return False
        if not (math.isfinite(x) and math.isfinite(y)) or abs(x - y) > REL_TOL * max(1.0, abs(y)):
            return False
    return True


def _split_tuple(s: str) -> list[str]:
    """The elements of "(a,b)" / "[a,b)" (brackets only at the ends), else [s]."""
    if len(s) > 2 and s[0] in _TUPLE_CHARS and s[-1] in _TUPLE_CHARS and \
            not any(ch in s[1:-1] for ch in _TUPLE_CHARS):
        return [e.strip() for e in s[1:-1].split(",")]
    return [s]


def grade(given: Optional[str], truth: str) -> bool:
    """Whether the answer `given` equals the reference `truth`: as normalised strings, or by value."""
    if given is None:
        return False
    g, t = normalize(given), normalize(str(truth))
    if g == t:
        return True
    if not g:
        return False
    g_elems, t_elems = _split_tuple(g), _split_tuple(t)
    if len(t_elems) > 1 and (g[0] != t[0] or g[-1] != t[-1]):  # "(1,2)" is not "[1,2]"
        return False
    if len(g_elems) != len(t_elems):
        return False
    return all(x == y or _same_value(x, y) for x, y in zip(g_elems, t_elems))


def compute_score(solution_str: str, ground_truth, format_score: float = FORMAT_SCORE) -> dict:
    """verl's score, (1 - format_score) * accuracy + format_score * format, with both parts as metrics."""
    acc = 1.0 if grade(extract_boxed(solution_str), str(ground_truth)) else 0.0
    fmt = format_reward(solution_str)
    return {"score": (1.0 - format_score) * acc + format_score * fmt, "acc": acc, "format": fmt}
