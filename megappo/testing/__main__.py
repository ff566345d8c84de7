"""`python -m megappo.testing {tokenizer,model} --out DIR`: write a tiny tokenizer or random-weight HF model."""
from __future__ import annotations

import argparse
import sys

from megappo.testing.hf_models import FAMILIES, make_hf_model
from megappo.testing.tokenizer import make_tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megappo.testing", description=__doc__)
    sub = parser.add_subparsers(dest="what", required=True)
    tok = sub.add_parser("tokenizer", help="train a 512-token BPE tokenizer with a chat template")
    tok.add_argument("--out", required=True)
    model = sub.add_parser("model", help="write a tiny random-weight HF model with its tokenizer")
    model.add_argument("--family", choices=sorted(FAMILIES), default="qwen2")
    model.add_argument("--out", required=True)
    model.add_argument("--seq-cls", action="store_true", help="a sequence-classification (reward) model")
    model.add_argument("--seed", type=int, default=0)
    model.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=INT",
        help="config overrides with integer values, e.g. hidden_size=256 num_hidden_layers=8",
    )
    args = parser.parse_args(argv)
    if args.what == "tokenizer":
        make_tokenizer(args.out)
    else:
        overrides = {k: int(v) for k, v in (kv.split("=", 1) for kv in args.set)}
        make_hf_model(args.family, args.out, seq_cls=args.seq_cls, seed=args.seed, **overrides)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
