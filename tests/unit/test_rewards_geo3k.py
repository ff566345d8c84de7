"""megappo.rewards.geo3k against verl 0.9.1's geo3k with mathruler 0.1.0 (recorded by
tools/verl_reference/geo3k_cases.py); nothing here needs verl, mathruler or sympy."""
import json
from pathlib import Path

import pytest

from megappo.rewards import default_compute_score, get_reward_fn, registered_data_sources
from megappo.rewards.geo3k import compute_score, extract_boxed, format_reward, grade

DATA = json.loads((Path(__file__).parents[1] / "data" / "verl_0_9_1" / "geo3k_cases.json").read_text())
CASES = DATA["cases"]

# (boxed answer, ground truth) that verl marks wrong and megappo right (the module docstring): values within the
# tolerance, integer references written as expressions, unreduced fractions, and the degree sign. Nothing else may
# differ.
DIFFERENT = {
    ("60°", "60"), ("2/4", "\\frac{1}{2}"), ("\\frac{2}{4}", "\\frac{1}{2}"), ("13.3333", "\\frac{40}{3}"),
    ("3.4641", "2\\sqrt{3}"), ("\\sqrt{9}", "3"), ("\\frac{\\sqrt3}{2}", "0.8660"), ("6.2832", "2\\pi"),
    ("25\\pi", "78.54"), ("78.5398", "25\\pi"), ("\\sqrt[3]{8}", "2"), ("2^3", "8"), ("2^{3}", "8"),
    ("3 \\times 4", "12"), ("12", "3 \\times 4"), ("14.1421", "10\\sqrt{2}"),
}


def _boxed_pair(case: dict) -> tuple:
    return extract_boxed(case["solution_str"]), case["ground_truth"]


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_agrees_with_verl(case):
    ours = compute_score(case["solution_str"], case["ground_truth"])
    assert ours["score"] == pytest.approx(0.9 * ours["acc"] + 0.1 * ours["format"])
    if _boxed_pair(case) in DIFFERENT:
        assert (case["score"], ours["score"]) == (pytest.approx(0.1), pytest.approx(1.0))
    else:
        assert ours["score"] == pytest.approx(case["score"])


def test_every_difference_is_recorded():
    assert DIFFERENT <= {_boxed_pair(c) for c in CASES}
    assert DATA["verl_version"] == "0.9.1"


def test_score_parts():
    good = "<think>The base angles are equal.</think> x = \\boxed{2\\sqrt{3}}"
    assert compute_score(good, "2\\sqrt{3}") == {"score": 1.0, "acc": 1.0, "format": 1.0}
    assert compute_score(good, "5") == {"score": pytest.approx(0.1), "acc": 0.0, "format": 1.0}
    assert compute_score("x = \\boxed{5}", "5") == {"score": pytest.approx(0.9), "acc": 1.0, "format": 0.0}
    assert format_reward("<think>a</think> no box") == 0.0
    assert extract_boxed("\\boxed{\\frac{1}{2}} and \\boxed{7") is None  # the last box never closes: no answer


@pytest.mark.parametrize("given, truth, same", [
    ("\\frac{1}{2}", "0.5", True), ("2\\sqrt{3}", "3.4641", True), ("2\\sqrt{3}", "3.46", False),
    ("x + 1", "1 + x", True), ("x + y + z", "z + y + x", False), ("(1, 2)", "[1, 2]", False), (None, "3", False),
])
def test_grade(given, truth, same):
    assert grade(given, truth) is same


def test_registered_for_geometry3k():
    assert "hiyouga/geometry3k" in registered_data_sources()
    assert get_reward_fn("hiyouga/geometry3k").__module__ == "megappo.rewards.registry"
    result = default_compute_score("hiyouga/geometry3k", "<think>t</think> \\boxed{0.5}", "\\frac{1}{2}", {})
    assert result["score"] == 1.0
