"""Rule reward for competition math (DAPO-Math-17k, AIME): the final answer against the reference answer.

Follows verl 0.9.1's `verl.utils.reward_score.math_dapo` (itself after Minerva / lm-evaluation-harness): only the
last 300 characters are read; the answer is the last "Answer: ..." line (case-insensitive), normalised (units,
"\\text{}", "$", "\\frac12" -> "\\frac{1}{2}", thousands commas, ...) and compared with the normalised reference;
without an "Answer:" line the last "\\boxed{...}" of the last 100 characters is compared with the reference as
written. The result is verl's: {"score": 1.0 or -1.0, "acc": bool, "pred": the answer read}.

Deliberate difference (the by-value reading of `megappo.rewards.gsm8k`), which only ever turns an answer verl marks
wrong into a correct one: when the two strings differ but both read as a number - an integer, a decimal, "a/b",
"\\frac{a}{b}" / "\\dfrac{a}{b}" / "\\tfrac{a}{b}", optionally negative, with thousands commas - they are compared
by value. So "18.0" == "18", "0.5" == "\\frac{1}{2}" == "1/2", "-0" == "0", "\\boxed{1,000}" == "1000". The
"\\boxed{}" fallback is read the same way (verl compares it as raw text: "\\boxed{ 18}" is wrong there).
Symbolic answers ("\\sqrt{2}", "x+1", intervals) are compared as strings, as verl does.
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional

_SOLUTION_CLIP_CHARS = 300  # verl: the longest answer in MATH-500 has 159 characters
_BOX_CLIP_CHARS = 100  # verl's strict-box window
INVALID = "[INVALID]"
_ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

# verl's normalisation tables, in verl's order (the replacements are applied one after another, so order matters)
_SUBSTITUTIONS = [
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
]
_REMOVED = [
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3",
    "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"', "\\dots",
]


def last_boxed(text: str) -> Optional[str]:
    """The contents of the last complete "\\boxed{...}" (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + len("\\boxed{"):i]
    return None


def normalize_final_answer(answer: str) -> str:
    """verl's (Minerva's) normalisation: the part after the last "=", units and TeX decoration removed."""
    answer = answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expr in _REMOVED:
        answer = answer.replace(expr, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)
    for command in ("text", "textbf", "overline"):
        answer = re.sub(r"(\\" + command + r"\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", answer)
    answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)  # \frac12 -> \frac{1}{2}
    answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer)  # \sqrt2 -> \sqrt{2}
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+"
_PLAIN_RE = re.compile(rf"(-)?\+?({_NUM})")
_SLASH_RE = re.compile(rf"(-)?({_NUM})/({_NUM})")
_FRAC_RE = re.compile(rf"(-)?\\[dt]?frac\{{(-)?({_NUM})\}}\{{(-)?({_NUM})\}}")


def _number(text: str) -> Fraction:
    return Fraction(text.replace(",", ""))


def as_value(text: Optional[str]) -> Optional[Fraction]:
    """The exact value of a plain numeric answer ("18", "-0.50", "1,000", "3/4", "\\frac{3}{4}", "-\\dfrac{1}{2}"),
    or None when the answer is anything else (symbols, units left over, several numbers)."""
    if text is None:
        return None
    text = text.strip().replace(" ", "").replace("{,}", ",")
    if text.startswith("{") and text.endswith("}"):
        text = text[1:-1]
    try:
        if m := _PLAIN_RE.fullmatch(text):
            value = _number(m.group(2))
            return -value if m.group(1) else value
        if m := _SLASH_RE.fullmatch(text):
            value = _number(m.group(2)) / _number(m.group(3))
            return -value if m.group(1) else value
        if m := _FRAC_RE.fullmatch(text):
            value = _number(m.group(3)) / _number(m.group(5))
            negative = bool(m.group(1)) ^ bool(m.group(2)) ^ bool(m.group(4))
            return -value if negative else value
    except ZeroDivisionError:
        return None
    return None


def _same(pred: Optional[str], gt: str) -> bool:
    if pred == gt:
        return True
    a, b = as_value(pred), as_value(gt)
    return a is not None and a == b


def verify(solution_str: str, ground_truth: str) -> tuple[bool, str]:
    """(correct, the answer read): the "Answer:" line first, else the last box of the last 100 characters."""
    matches = _ANSWER_RE.findall(solution_str)
    pred = normalize_final_answer(matches[-1] if matches else INVALID)
    if pred != INVALID:
        return _same(pred, normalize_final_answer(ground_truth)), pred
    boxed = last_boxed(solution_str[-_BOX_CLIP_CHARS:])
    if boxed is not None:
        return _same(boxed, ground_truth), boxed
    return False, pred


def compute_score(solution_str: str, ground_truth) -> dict:
    """verl's result: {"score": 1.0 if correct else -1.0, "acc": correct, "pred": the answer read}."""
    correct, pred = verify(solution_str[-_SOLUTION_CLIP_CHARS:], str(ground_truth))
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
