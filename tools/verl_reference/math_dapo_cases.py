"""Record verl 0.9.1's math_dapo reward on a list of answers, for megappo's agreement test.

    python tools/verl_reference/math_dapo_cases.py PATH_TO_VERL [--out tests/data/verl_0_9_1/math_dapo_cases.json]

PATH_TO_VERL is a directory holding the ``verl`` package of release 0.9.1 (a checkout of the v0.9.1 tag, or the
unpacked wheel: ``pip download verl==0.9.1 --no-deps`` and unzip it; that is what the stored file was made from).
``verl/utils/reward_score/math_dapo.py`` imports only ``re`` and ``typing``, so it is loaded on its own with importlib
(importing ``verl`` would pull in Ray and the config tree). Each case records verl's ``compute_score`` result
({"score", "acc", "pred"}); megappo's test compares with it and lists the cases where megappo deliberately differs.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

# (solution_str, ground_truth): answer lines, boxes, units, TeX, fractions, and the by-value cases
CASES = [
    ("So the total is 34.\nAnswer: 34", "34"),
    ("Answer: 35", "34"),
    ("answer:   34 ", "34"),
    ("First Answer: 12\nThen Answer: 34", "34"),
    ("Answer: $34$", "34"),
    ("Answer: 34 dollars", "34"),
    ("Answer: 90^\\circ", "90"),
    ("Answer: x = 5", "5"),
    ("Answer: \\frac12", "\\frac{1}{2}"),
    ("Answer: \\frac{1}{2}", "\\frac{1}{2}"),
    ("Answer: \\dfrac{1}{2}", "\\frac{1}{2}"),
    ("Answer: 0.5", "\\frac{1}{2}"),
    ("Answer: 1/2", "\\frac{1}{2}"),
    ("Answer: 18.0", "18"),
    ("Answer: 18.00", "18"),
    ("Answer: -0", "0"),
    ("Answer: 1,000", "1000"),
    ("Answer: 1{,}000", "1000"),
    ("Answer: \\text{(B)}", "(B)"),
    ("Answer: \\sqrt2", "\\sqrt{2}"),
    ("Answer: 2\\sqrt{3}", "2\\sqrt{3}"),
    ("Answer: 10 units", "10"),
    ("Answer: \\boxed{42}", "42"),
    ("Answer: -\\frac{3}{4}", "-\\frac{3}{4}"),
    ("Answer: -0.75", "-\\frac{3}{4}"),
    ("The answer is \\boxed{42}.", "42"),
    ("The answer is \\boxed{41}.", "42"),
    ("The answer is \\boxed{ 42}.", "42"),
    ("The answer is \\boxed{42.0}.", "42"),
    ("The answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("The answer is \\boxed{0.5}.", "\\frac{1}{2}"),
    ("\\boxed{3} then \\boxed{7}", "7"),
    ("\\boxed{7" + "x" * 120, "7"),
    ("\\boxed{7}" + " and some more text" * 6, "7"),
    ("unclosed \\boxed{7", "7"),
    ("no answer at all", "7"),
    ("", "7"),
    ("Answer: 7", "[INVALID]"),
    ("x" * 400 + "Answer: 9", "9"),
    ("Answer: 9" + "x" * 400, "9"),
    ("Answer: 3/0", "3/0"),
    ("Answer: 1/0", "2/0"),
    ("Answer: a 5", "5"),
    ("Answer: (1, 2)", "(1,2)"),
    ("Answer: 5 \\text{cm}^2", "5"),
    ("Answer: 0.1", "0.10"),
    ("Answer: 204", "204"),
    ("The final answer is 204.\nAnswer: 204.", "204"),
]


def load_math_dapo(verl_root: Path):
    pkg = verl_root / "verl"
    version = (pkg / "version" / "version").read_text().strip()
    if version != "0.9.1":
        print(f"warning: {pkg} is verl {version}, not 0.9.1", file=sys.stderr)
    spec = importlib.util.spec_from_file_location("verl_math_dapo", pkg / "utils" / "reward_score" / "math_dapo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("verl_root", type=Path)
    parser.add_argument("--out", type=Path, default=Path("tests/data/verl_0_9_1/math_dapo_cases.json"))
    args = parser.parse_args()
    verl = load_math_dapo(args.verl_root)
    cases = []
    for solution, gt in CASES:
        result = verl.compute_score(solution, gt)
        cases.append({"solution_str": solution, "ground_truth": gt, "score": result["score"],
                      "acc": bool(result["acc"]), "pred": result["pred"]})
    args.out.write_text(json.dumps({"verl_version": "0.9.1", "cases": cases}, indent=1) + "\n")
    print(f"wrote {len(cases)} cases to {args.out}")


if __name__ == "__main__":
    main()
