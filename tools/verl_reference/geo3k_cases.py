"""Record verl 0.9.1's geo3k reward (mathruler's grader) on a list of responses, for megappo's agreement test.

    python tools/verl_reference/geo3k_cases.py PATH_TO_VERL PATH_TO_MATHRULER PATH_TO_PYLATEXENC \\
        [--out tests/data/verl_0_9_1/geo3k_cases.json]

Each PATH is a directory holding the package of that name: the unpacked wheels of ``verl==0.9.1``,
``mathruler==0.1.0`` and ``pylatexenc==2.11`` (``pip download verl==0.9.1 mathruler==0.1.0 pylatexenc==2.11
--no-deps`` and unzip each; that is what the stored file was made from). ``verl/utils/reward_score/geo3k.py``
imports only ``re`` and ``mathruler.grader`` (which needs sympy, pylatexenc and tqdm), so it is loaded on its own
with importlib. Each case records verl's ``compute_score`` (a float: 0.9 * accuracy + 0.1 * format).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

# (boxed answer, ground truth): geometry answers as Geometry3K writes them (integers, decimals, \frac, \sqrt, \pi),
# the forms a model writes for them, and the by-value cases where megappo deliberately differs
ANSWERS = [
    ("3", "3"), ("4", "3"), ("3.0", "3"), ("3.00", "3"), ("03", "3"), ("-3", "3"), ("x = 3", "3"), ("x=3", "3"),
    ("3^\\circ", "3"), ("60^{\\circ}", "60"), ("60°", "60"), ("60 degrees", "60"), ("5 cm", "5"), ("5\\text{ cm}", "5"),
    ("\\text{5}", "5"), ("{5}", "5"), ("$5$", "5"), ("12.5", "12.5"), ("12.50", "12.5"), ("12.6", "12.5"),
    ("0.5", "\\frac{1}{2}"), ("\\frac{1}{2}", "0.5"), ("\\dfrac{1}{2}", "\\frac{1}{2}"), ("\\frac12", "\\frac{1}{2}"),
    ("1/2", "\\frac{1}{2}"), ("2/4", "\\frac{1}{2}"), ("\\frac{2}{4}", "\\frac{1}{2}"), ("\\frac{40}{3}", "13.33"),
    ("13.3333", "\\frac{40}{3}"), ("\\frac{40}{3}", "\\frac{40}{3}"), ("2\\sqrt{3}", "2\\sqrt{3}"),
    ("2 \\sqrt 3", "2\\sqrt{3}"), ("\\sqrt{12}", "2\\sqrt{3}"), ("2\\sqrt3", "2\\sqrt{3}"), ("3.4641", "2\\sqrt{3}"),
    ("3.46", "2\\sqrt{3}"), ("2\\sqrt{3}", "3.46"), ("\\sqrt{3}", "2\\sqrt{3}"), ("\\sqrt{9}", "3"),
    ("4\\sqrt{2}", "\\sqrt{32}"), ("\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt{3}}{2}"), ("\\frac{\\sqrt3}{2}", "0.8660"),
    ("\\frac{3}{\\sqrt{3}}", "\\sqrt{3}"), ("2\\pi", "2\\pi"), ("6.2832", "2\\pi"), ("2 \\pi", "2\\pi"),
    ("\\pi \\cdot 2", "2\\pi"), ("25\\pi", "78.54"), ("78.5398", "25\\pi"), ("\\frac{25\\pi}{2}", "12.5\\pi"),
    ("7 3/4", "\\frac{31}{4}"), ("1,000", "1000"), ("1000", "1,000"), ("x+1", "1+x"), ("2x", "x \\cdot 2"),
    ("x^2", "x \\cdot x"), ("x+y", "y+x"), ("x+2", "x+1"), ("\\sqrt[3]{8}", "2"), ("2^3", "8"), ("2^{3}", "8"),
    ("(1,2)", "(1, 2)"), ("(1,2)", "[1,2]"), ("(2,1)", "(1,2)"), ("(1,2,3)", "(1,2)"), ("A", "A"), ("a", "A"),
    ("\\text{A}", "A"), ("yes", "no"), ("", "3"), ("50\\%", "50"), ("3.14", "\\pi"), ("\\frac{1}{0}", "1"),
    ("\\sqrt{-4}", "2"), ("9^9^9^9", "1"), ("\\sin 30", "0.5"), ("\\left(3\\right)", "3"), ("(3)", "3"),
    ("3 \\times 4", "12"), ("12", "3 \\times 4"), ("-\\frac{1}{2}", "-0.5"), ("\\frac{-1}{2}", "-0.5"),
    ("- 0.5", "-0.5"), ("10\\sqrt{2}", "14.14"), ("14.1421", "10\\sqrt{2}"), ("14.14", "14.142"),
]
# whole responses, for the format check and boxed extraction
RESPONSES = [
    ("<think>The angles sum to 180.</think> So x = \\boxed{3}.", "3"),
    ("<think>wrong</think> \\boxed{4}", "3"),
    ("<think>no box</think> The answer is 3.", "3"),
    ("The answer is \\boxed{3}.", "3"),
    ("<think>a</think>\n<think>b</think> \\boxed{3}", "3"),
    ("<think>\nmulti\nline\n</think>\n\\boxed{\\frac{1}{2}}\n", "0.5"),
    ("</think><think> \\boxed{3}", "3"),
    ("<think>x</think> \\boxed{2} then \\boxed{3}", "3"),
    ("<think>x</think> \\boxed{3", "3"),
    ("<think>x</think> \\boxed{\\frac{1}{2}} extra text after", "\\frac{1}{2}"),
    ("<think>x</think> \\boxed{ 3 }", "3"),
    ("", "3"),
    ("\\boxed{}", "3"),
    ("<think>x</think>\\boxed{\\text{None}}", "None"),
]


def load_geo3k(verl_root: Path, mathruler_root: Path, pylatexenc_root: Path):
    pkg = verl_root / "verl"
    version = (pkg / "version" / "version").read_text().strip()
    if version != "0.9.1":
        print(f"warning: {pkg} is verl {version}, not 0.9.1", file=sys.stderr)
    sys.path[:0] = [str(mathruler_root), str(pylatexenc_root)]
    spec = importlib.util.spec_from_file_location("verl_geo3k", pkg / "utils" / "reward_score" / "geo3k.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def responses() -> list[tuple[str, str]]:
    wrapped = [(f"<think>Reasoning about the diagram.</think> The answer is \\boxed{{{given}}}.", gt)
               for given, gt in ANSWERS]
    return wrapped + RESPONSES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("verl_root", type=Path)
    parser.add_argument("mathruler_root", type=Path)
    parser.add_argument("pylatexenc_root", type=Path)
    parser.add_argument("--out", type=Path, default=Path("tests/data/verl_0_9_1/geo3k_cases.json"))
    args = parser.parse_args()
    verl = load_geo3k(args.verl_root, args.mathruler_root, args.pylatexenc_root)
    cases = [{"solution_str": s, "ground_truth": gt, "score": float(verl.compute_score(s, gt))}
             for s, gt in responses()]
    args.out.write_text(json.dumps({"verl_version": "0.9.1", "mathruler_version": "0.1.0", "cases": cases},
                                   indent=1) + "\n")
    print(f"wrote {len(cases)} cases to {args.out}")


if __name__ == "__main__":
    main()
