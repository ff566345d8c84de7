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


def _missing_dataset(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _gsm8k(args: argparse.Namespace) -> int:
    import os

    from megappo.data.gsm8k import convert
    from megappo.data.errors import DataError

    try:
        counts = convert(args.input, args.out, force=args.force)
    except (DataError, FileExistsError) as e:
        print(f"megappo data gsm8k: error: {e}", file=sys.stderr)
        return 1
    out = os.path.abspath(os.path.expanduser(args.out))
    for split, n in counts.items():
        print(f"wrote {os.path.join(out, split + '.parquet')} ({n} prompts)")
    return 0
