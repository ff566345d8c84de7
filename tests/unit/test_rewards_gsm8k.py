"""megappo.rewards.gsm8k: answer extraction and scoring (strict and flexible)."""
import pytest

from megappo.rewards.gsm8k import compute_score, extract_solution, parse_ground_truth


@pytest.mark.parametrize(
    "text, strict, flexible",
    [
        ("48 + 24 = 72\n#### 72", "72", "72"),
        ("#### 1,234", "1234", "1234"),
        ("She earns $18 a day.\n#### $18", "18", "18"),
        ("#### $ 1,000,000", "1000000", "1000000"),
        ("#### -5", "-5", "-5"),
        ("#### -$5", "-5", "-5"),
        ("#### 18.00", "18", "18"),
        ("#### 72.", "72", "72"),  # the sentence's period is not a decimal point
        ("So 10 - 5", None, "5"),  # a minus after a space is an operator, not a sign
        ("#### 3 then later #### none", None, "3"),  # strict reads only after the last ####
        ("The answer is 7, not 1,2,3", None, "3"),  # "1,2,3" is a list, not 123
        ("no numbers here", None, None),
        ("", None, None),
    ],
)
def test_extract_solution(text, strict, flexible):
    def as_str(v):
        return None if v is None else format(v.normalize(), "f")

    assert as_str(extract_solution(text, "strict")) == strict
    assert as_str(extract_solution(text, "flexible")) == flexible


def test_compute_score_strict_and_flexible():
    assert compute_score("blah\n#### 72", "72") == 1.0
    assert compute_score("blah\n#### 71", "72") == 0.0
    assert compute_score("blah\n#### 71", "72", format_score=0.1) == 0.1  # answer found but wrong
    assert compute_score("the answer is 72", "72", format_score=0.1) == 0.0  # strict: no "####" at all
    assert compute_score("the answer is 72", "72", method="flexible") == 1.0
    assert compute_score("#### 1,234", "1234", score=2.0) == 2.0
    assert compute_score("#### 1234", "1,234") == 1.0  # a ground truth with separators is read too
    assert compute_score("#### $18.00", "18") == 1.0
    assert compute_score("#### -3", "3") == 0.0
    assert compute_score("#### 0.5", "0.50") == 1.0


def test_only_the_end_of_a_long_solution_is_searched():
    # verl's behaviour: only the last 300 characters are scanned (regexes over long generations are slow).
    assert compute_score("#### 72" + " filler" * 100, "72", method="strict") == 0.0
    assert compute_score("x" * 10_000 + "\n#### 72", "72") == 1.0


def test_bad_inputs():
    with pytest.raises(ValueError, match="strict' or 'flexible"):
        extract_solution("#### 1", method="loose")
    with pytest.raises(ValueError, match="ground_truth"):
        parse_ground_truth("seventy-two")
    assert parse_ground_truth(72) == parse_ground_truth("72.0")
