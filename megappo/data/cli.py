"""`megappo data ...`: prepare prompt datasets. Registration imports nothing heavy; handlers import lazily."""
from __future__ import annotations

import argparse
import sys


def register(subparsers) -> None:
    data = subparsers.add_parser(
        "data",
        help="prepare prompt datasets (Parquet in verl's schema)",
        description="Prepare prompt datasets as Parquet in verl's schema: data_source, prompt (chat messages), "
        "ability, reward_model {style, ground_truth}, extra_info. Point data.train_files/val_files at the output.",
    )
    data_sub = data.add_subparsers(dest="data_command", metavar="DATASET")
    data.set_defaults(func=lambda args: _missing_dataset(data))

    gsm8k = data_sub.add_parser(
        "gsm8k",
        help="GSM8K jsonl or Hugging Face files -> train.parquet and test.parquet",
        description="Convert GSM8K to OUT/train.parquet and OUT/test.parquet. Reads INPUT/train.jsonl and "
        "INPUT/test.jsonl (the original release) or a Hugging Face snapshot of openai/gsm8k "
        "(INPUT/main/train-00000-of-00001.parquet, ...). Each prompt is the question followed by "
        "'Let's think step by step and output the final answer after \"####\".'; the ground truth is the number "
        "after the reference answer's '####' with thousands separators removed; data_source is 'openai/gsm8k'.",
        epilog="example: megappo data gsm8k --input ../shared/data/gsm8k --out ~/data/gsm8k",
    )
    gsm8k.add_argument("--input", required=True, metavar="DIR", help="directory holding the GSM8K files")
    gsm8k.add_argument("--out", default="~/data/gsm8k", metavar="DIR",
                       help="output directory (default: ~/data/gsm8k, the default data.train_files/val_files)")
    gsm8k.add_argument("--force", action="store_true", help="overwrite existing train.parquet/test.parquet")
    gsm8k.set_defaults(func=_gsm8k)

    geo3k = data_sub.add_parser(
        "geo3k",
        help="Geometry3K (images + problems) -> train.parquet and test.parquet, multimodal",
        description="Convert Geometry3K to OUT/train.parquet and OUT/test.parquet in verl's multimodal schema "
        "(images as bytes in an `images` column, one <image> placeholder per image in the prompt). Reads a copy of "
        "the Hugging Face dataset hiyouga/geometry3k (INPUT/data/train-*.parquet, INPUT/data/test-*.parquet) or "
        "Inter-GPS's original release (INPUT/train/<id>/data.json + img_diagram.png, INPUT/test/<id>/...). Each "
        "prompt is the problem followed by verl's <think>/\\boxed{} instruction; data_source is "
        "'hiyouga/geometry3k', scored by megappo.rewards.geo3k.",
        epilog="example: megappo data geo3k --input megappo/data/samples/geo3k --out ~/data/geo3k",
    )
    geo3k.add_argument("--input", required=True, metavar="DIR", help="directory holding the Geometry3K files")
    geo3k.add_argument("--out", "--output", dest="out", default="~/data/geo3k", metavar="DIR",
                       help="output directory (default: ~/data/geo3k, where recipes/geo3k read)")
    geo3k.add_argument("--force", action="store_true", help="overwrite existing train.parquet/test.parquet")
    geo3k.set_defaults(func=_geo3k)

    for name, out_file, help_, desc in (
        ("dapo-math", "dapo-math-17k.parquet", "DAPO-Math-17k -> dapo-math-17k.parquet (DAPO's training set)",
         "Convert BytedTsinghua-SIA/DAPO-Math-17k (INPUT: its dapo-math-17k.parquet, or a directory holding it, "
         "also under data/) to OUT/dapo-math-17k.parquet. The file is already in verl's schema (data_source "
         "math_dapo, scored by megappo.rewards.math_dapo); it is checked, and the copies of each problem in the "
         "public file (about 100 each) are dropped unless --keep-duplicates."),
        ("aime2024", "aime-2024.parquet", "AIME 2024 -> aime-2024.parquet (DAPO's validation set)",
         "Convert AIME 2024 to OUT/aime-2024.parquet. Reads Maxwell-Jia/AIME_2024 (aime_2024_problems.parquet: "
         "ID, Problem, Solution, Answer; given DAPO's prompt and data_source aime2024) or verl's "
         "BytedTsinghua-SIA/AIME-2024 (aime-2024.parquet, verl's schema; its 32 copies of each problem are dropped "
         "unless --keep-duplicates: set actor_rollout_ref.rollout.val_kwargs.n=32 for avg@32)."),
    ):
        sub = data_sub.add_parser(name, help=help_, description=desc,
                                  epilog=f"example: megappo data {name} --input ~/downloads/{name} --out ~/data/dapo")
        sub.add_argument("--input", required=True, metavar="PATH", help="the downloaded Parquet file or its directory")
        sub.add_argument("--out", default="~/data/dapo", metavar="DIR",
                         help=f"output directory (default: ~/data/dapo, where recipes/dapo read {out_file})")
        sub.add_argument("--force", action="store_true", help=f"overwrite an existing {out_file}")
        sub.add_argument("--keep-duplicates", action="store_true", help="keep repeated problems as published")
        sub.set_defaults(func=_dapo, dataset=name)


def _missing_dataset(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _gsm8k(args: argparse.Namespace) -> int:
    from megappo.data import gsm8k

    return _convert_splits("gsm8k", gsm8k.convert, args)


def _geo3k(args: argparse.Namespace) -> int:
    from megappo.data import geo3k

    return _convert_splits("geo3k", geo3k.convert, args)


def _convert_splits(name: str, convert, args: argparse.Namespace) -> int:
    """`convert(input, out, force=)` -> {split: prompts}; one line per file written, or the error and exit 1."""
    import os

    from megappo.data.errors import DataError

    try:
        counts = convert(args.input, args.out, force=args.force)
    except (DataError, FileExistsError) as e:
        print(f"megappo data {name}: error: {e}", file=sys.stderr)
        return 1
    out = os.path.abspath(os.path.expanduser(args.out))
    for split, n in counts.items():
        print(f"wrote {os.path.join(out, split + '.parquet')} ({n} prompts)")
    return 0


def _dapo(args: argparse.Namespace) -> int:
    from megappo.data import dapo
    from megappo.data.errors import DataError

    convert = dapo.convert_dapo_math if args.dataset == "dapo-math" else dapo.convert_aime2024
    try:
        path, n = convert(args.input, args.out, force=args.force, keep_duplicates=args.keep_duplicates)
    except (DataError, FileExistsError) as e:
        print(f"megappo data {args.dataset}: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {path} ({n} prompts)")
    return 0
