"""The `megappo` console command.

Each subcommand lives in its own module and exposes `register(subparsers)`, which adds an argparse parser whose
`func` default is the handler. Registration must not import torch or megatron so that `megappo --help` is instant;
handlers import what they need.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# (module, attribute) of each subcommand's register function, in the order `--help` lists them.
SUBCOMMANDS = [
    ("megappo.train_cli", "register"),
    ("megappo.data.cli", "register"),
    ("megappo.convert.cli", "register"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megappo", description="KL-regularized PPO for LLMs on megatron-core."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module, attr in SUBCOMMANDS:
        try:
            register = getattr(importlib.import_module(module), attr)
        except ModuleNotFoundError as e:  # a subcommand whose module is not written yet
            if e.name != module:
                raise
            continue
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
