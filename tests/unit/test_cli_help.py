"""Every `megappo` subcommand answers `--help` with usage text, without importing torch or megatron."""
from __future__ import annotations

import subprocess
import sys

import pytest

from megappo.cli import build_parser

SUBCOMMANDS = [
    [],
    ["train"],
    ["data"],
    ["data", "gsm8k"],
    ["convert"],
    ["convert", "hf-to-mcore"],
    ["convert", "mcore-to-hf"],
    ["convert", "verify"],
    ["rollout-server"],
]


@pytest.mark.parametrize("argv", SUBCOMMANDS, ids=lambda a: " ".join(a) or "megappo")
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*argv, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: megappo")
    assert len(out.splitlines()) > 3, f"--help of {argv} says too little:\n{out}"


def test_every_subcommand_is_registered():
    names = set(build_parser()._subparsers._group_actions[0].choices)  # noqa: SLF001 - argparse has no public API
    assert {"train", "data", "convert", "rollout-server"} <= names


def test_help_does_not_import_heavy_modules():
    code = (
        "import sys; from megappo.cli import build_parser; build_parser();"
        "heavy = [m for m in ('torch', 'megatron', 'transformers', 'pyarrow', 'ray') if m in sys.modules];"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"`megappo --help` imports {out}; keep register() free of heavy imports"


def test_console_script_runs():
    out = subprocess.run(
        [sys.executable, "-m", "megappo.cli", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "convert" in out and "train" in out
