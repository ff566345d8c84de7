"""Rule reward for GSM8K: compare the model's final number with the reference answer.

Follows verl's `verl.utils.reward_score.gsm8k` (strict reads the answer after "####", flexible the last number;
only the last 300 characters are searched), with these deliberate differences, because each one only turns a
correct answer that verl would mark wrong into a correct one:

- Numbers are compared by value, not as strings: "18.00" == "18" and "-0" == "0". Reference answers in GSM8K are
  integers; a model that writes "18.00" has the right answer.
- "$18", "$ 18", "-$18", "1,234" and "1,234.50" are read as numbers ("$" and thousands separators dropped).
- A sentence-ending period is not part of the number: "#### 18." reads 18.
- Strict mode takes the number right after the LAST "####"; if that last "####" has no number after it there is no
  answer (verl instead falls back to an earlier "#### N").
"""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# Long generations make regex scans slow; the final answer is at the end (verl clips the same way).
_SOLUTION_CLIP_CHARS = 300

# An optional sign and/or "$" in either order (a space only after "$", so "10 - 5" ends in 5, not -5), then digits
# with optional thousands groups and decimals. A thousands group is taken only when it has exactly three digits, so
# "1,2,3" reads 1, 2, 3 and not 123.
_NUMBER = r"(?P<neg1>-)?(?:\$\s?)?(?P<neg2>-)?(?P<num>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
_NUMBER_RE = re.compile(_NUMBER)
_STRICT_RE = re.compile(r"####\s*" + _NUMBER)


def _to_decimal(match: re.Match) -> Decimal:
    text = match.group("num").replace(",", "")
    value = Decimal(text)
    return -value if (match.group("neg1") or match.group("neg2")) else value


def extract_solution(solution_str: str, method: str = "strict") -> Decimal | None:
    """The final numeric answer in `solution_str`, or None when there is none.

    strict: the number right after the last "####" (the format the GSM8K prompt asks for).
    flexible: the last number anywhere in the text.
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")
    text = solution_str[-_SOLUTION_CLIP_CHARS:]
    if method == "strict":
        last = text.rfind("####")
        if last < 0:
            return None
        match = _STRICT_RE.match(text, last)
        return _to_decimal(match) if match else None
    matches = list(_NUMBER_RE.finditer(text))
    return _to_decimal(matches[-1]) if matches else None


def parse_ground_truth(ground_truth: str | int | float) -> Decimal:
    """The reference answer as a number; accepts "1,234", "$18", "-3", "18.00" and plain ints/floats."""
    if isinstance(ground_truth, (int, float)) and not isinstance(ground_truth, bool):
        return Decimal(str(ground_truth))
    match = _NUMBER_RE.fullmatch(str(ground_truth).strip())
    if match is None:
        raise ValueError(
            f"gsm8k ground_truth {ground_truth!r} is not a number; the dataset's reward_model.ground_truth must "
            "hold the final answer only (e.g. '72'), as `megappo data gsm8k` writes it"
        )
    return _to_decimal(match)


def compute_score(
    solution_str: str,
    ground_truth: str | int | float,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """`score` when the extracted answer equals `ground_truth`, `format_score` when an answer was found but is
    wrong, and 0.0 when no answer was found."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    try:
        correct = answer == parse_ground_truth(ground_truth)
    except InvalidOperation:  # unreachable for regex-matched text; kept so a bad value never crashes a worker
        correct = False
    return float(score) if correct else float(format_score)
