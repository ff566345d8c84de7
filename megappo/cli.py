"""The `megappo` console command.

Each subcommand lives in its own module and exposes `register(subparsers)`, which adds an argparse parser whose
`func` default is the handler. Registration must not import torch or megatron so that `megappo --help` is instant;
handlers import what they need.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

# (module, attribute) of each subcommand's register function, in the order `--help` lists them.
SUBCOMMANDS = [
    ("megappo.train_cli", "register"),
    ("megappo.data.cli", "register"),
    ("megappo.convert_cli", "register"),
    ("megappo.rollout_server_cli", "register"),
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


def _quiet_known_warnings() -> None:
    """Hide warnings a user cannot act on: megatron-core announcing its fallbacks when transformer-engine or apex
    is absent (always, on CPU) and deprecations inside megatron's own calls into torch. MEGAPPO_WARNINGS=1 shows
    them."""
    if os.environ.get("MEGAPPO_WARNINGS") == "1":
        return
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed")
    warnings.filterwarnings("ignore", message=r".*cuda_graph_scope")
    # torch's checkpoint reader run in one process on purpose (streamed mcore-to-hf)
    warnings.filterwarnings("ignore", message=r"torch.distributed is disabled, unavailable or uninitialized")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(megatron|torch)\.")


def main(argv: list[str] | None = None) -> int:
    _quiet_known_warnings()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
