"""Record and compare golden metrics: every CPU recipe's metrics, bit for bit (megappo/testing/golden.py).

    python tools/golden.py list
    python tools/golden.py record [NAME ...]     # all runs without NAME; writes tests/golden/NAME.jsonl
    python tools/golden.py compare [NAME ...]    # runs again; exit 1 when a number moved
    python tools/golden.py extend [NAME ...]     # records again where no number moved (new metrics added)

A change that is meant to move no number (a reorganisation) must compare clean; one that is meant to move numbers
records the runs it moves again, in a commit of its own that says why. `--sglang-python` (or
$MEGAPPO_SGLANG_PYTHON) and `--vllm-python` (or $MEGAPPO_VLLM_PYTHON) are the engines' environments' pythons for the
runs whose rollout is such a server (skipped without it).
"""
from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from pathlib import Path

from megappo.testing import golden


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/golden.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    # extend: record again only where every number the golden holds comes out the same (a new metric added)
    parser.add_argument("action", choices=["list", "record", "compare", "extend"])
    parser.add_argument("names", nargs="*", help=f"runs (default all): {', '.join(golden.RUNS)}")
    parser.add_argument("--jobs", type=int, default=2, help="single-rank runs at a time (default 2)")
    parser.add_argument("--sglang-python", default=os.environ.get("MEGAPPO_SGLANG_PYTHON"))
    parser.add_argument("--vllm-python", default=os.environ.get("MEGAPPO_VLLM_PYTHON"))
    parser.add_argument("--dir", type=Path, default=golden.GOLDEN_DIR, help="where the golden files are")
    parser.add_argument("--keep", type=Path, help="compare: keep each run's directory under KEEP/NAME")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in golden.RUNS]
    if unknown:
        parser.error(f"unknown run(s) {unknown}: choose from {', '.join(golden.RUNS)}")
    names = args.names or list(golden.RUNS)
    if args.action == "list":
        for name, spec in golden.RUNS.items():
            print(f"{name:22s} {spec.recipe} {' '.join(spec.overrides)}" + (f" ({spec.nproc} ranks)" * (spec.nproc > 1)))
        return 0
    pythons = {engine: python for engine, python in (("sglang", args.sglang_python), ("vllm", args.vllm_python))
               if python}
    skipped = [n for n in names if golden.RUNS[n].server and golden.RUNS[n].server not in pythons]
    names = [n for n in names if n not in skipped]
    for name in skipped:
        print(f"{name}: skipped (needs --{golden.RUNS[name].server}-python)")
    if args.action == "record":
        one = partial(golden.record_one, server_pythons=pythons, directory=args.dir)
    elif args.action == "extend":
        one = partial(golden.extend_one, server_pythons=pythons, directory=args.dir)
    else:
        one = partial(golden.compare_one, server_pythons=pythons, directory=args.dir, keep=args.keep)
    failed = 0
    for outcome in golden.run_all(names, one, args.jobs):
        if outcome.error:
            print(f"{outcome.name}: FAILED TO RUN\n{outcome.error}")
        elif outcome.differences and outcome.schedule:
            print(f"{outcome.name}: same until the asynchronous schedule's timing moved ({outcome.schedule}): "
                  "rerun it on a quieter machine")
        elif outcome.differences:
            note = f" (recorded on another CPU: {outcome.other_cpu})" if outcome.other_cpu else ""
            print(f"{outcome.name}: DIFFERS{note}\n  " + "\n  ".join(outcome.differences))
        else:
            print(f"{outcome.name}: {'same' if args.action == 'compare' else 'recorded'}")
        failed += not outcome.ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
