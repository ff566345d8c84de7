"""megappo.rewards.math_dapo against verl 0.9.1's math_dapo (recorded by tools/verl_reference/math_dapo_cases.py)."""
import json
from pathlib import Path

import pytest

from megappo.rewards import default_compute_score, get_reward_fn, registered_data_sources
from megappo.rewards.math_dapo import as_value, compute_score

CASES = json.loads((Path(__file__).parents[1] / "data" / "verl_0_9_1" / "math_dapo_cases.json").read_text())["cases"]

# Where megappo reads by value and verl compares strings (the module docstring): verl marks these wrong, megappo
# right. Nothing else may differ.
BY_VALUE = {
    ("Answer: \\dfrac{1}{2}", "\\frac{1}{2}"), ("Answer: 0.5", "\\frac{1}{2}"), ("Answer: 1/2", "\\frac{1}{2}"),
    ("Answer: 18.0", "18"), ("Answer: 18.00", "18"), ("Answer: -0", "0"), ("Answer: -0.75", "-\\frac{3}{4}"),
    ("The answer is \\boxed{ 42}.", "42"), ("The answer is \\boxed{42.0}.", "42"),
    ("The answer is \\boxed{0.5}.", "\\frac{1}{2}"), ("Answer: 0.1", "0.10"),
    ("The final answer is 204.\nAnswer: 204.", "204"),
}


@pytest.mark.parametrize("case", CASES, ids=[f"{i}" for i in range(len(CASES))])
def test_agrees_with_verl(case):
    ours = compute_score(case["solution_str"], case["ground_truth"])
    assert ours["pred"] == case["pred"]
    if (case["solution_str"], case["ground_truth"]) in BY_VALUE:
        assert (case["score"], ours["score"], ours["acc"]) == (-1.0, 1.0, True)
    else:
        assert (ours["score"], ours["acc"]) == (case["score"], case["acc"])


def test_every_by_value_case_is_recorded():
    assert BY_VALUE <= {(c["solution_str"], c["ground_truth"]) for c in CASES}


@pytest.mark.parametrize("text, value", [
    ("18", 18), ("-0.50", -0.5), ("1,000", 1000), ("3/4", 0.75), ("\\frac{3}{4}", 0.75), ("-\\dfrac{1}{2}", -0.5),
    ("\\frac{-1}{2}", -0.5), ("{7}", 7), ("1/0", None), ("\\sqrt{2}", None), ("x+1", None), ("1,2", None), ("", None),
])
def test_as_value(text, value):
    got = as_value(text)
    assert (got is None and value is None) or float(got) == value


def test_registered_sources_match_verl():
    fn = get_reward_fn("math_dapo")
    for source in ("math", "math_dapo_reasoning", "aime2024", "aime_2025", "aime"):
        assert get_reward_fn(source) is fn
    assert "aime*" in registered_data_sources()
    assert default_compute_score("aime2024", "Answer: 204", "204") == {"score": 1.0, "acc": True, "pred": "204"}
    with pytest.raises(ValueError, match="no reward function"):
        get_reward_fn("AIME2024")  # verl's prefix match is case-sensitive
