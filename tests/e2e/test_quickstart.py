"""The conversion tour, `tools/quickstart.sh` (docs/training.md, "Other CPU runs"), end to end on real GSM8K and a
tiny model (torchrun included)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "megappo" / "data" / "samples" / "gsm8k"


def test_quickstart_runs_every_stage_on_the_bundled_sample(tmp_path):
    out = tmp_path / "quickstart"
    env = {k: v for k, v in os.environ.items() if k != "GSM8K_DIR"}  # the default: the sample in the repository
    env["OUT"] = str(out)
    proc = subprocess.run(
        ["bash", str(REPO / "tools" / "quickstart.sh")], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "wrote" in proc.stdout and "(64 prompts)" in proc.stdout and "(16 prompts)" in proc.stdout, proc.stdout
    assert "config OK" in proc.stdout, proc.stdout  # step 3: the tiny recipe's preflight against this data and model
    assert proc.stdout.count("-> OK") == 3, proc.stdout  # TP1, TP2 (rank 0 prints) and the exported directory
    for path in ("data/train.parquet", "data/test.parquet", "mcore", "hf_export/config.json",
                 "hf_export/model.safetensors.index.json", "hf_export/tokenizer.json"):
        assert (out / path).exists(), path


def test_sample_is_there_with_its_license():
    assert sum(1 for _ in open(SAMPLE / "train.jsonl")) == 64 and sum(1 for _ in open(SAMPLE / "test.jsonl")) == 16
    assert "MIT License" in (SAMPLE / "LICENSE").read_text() and "openai/gsm8k" in (SAMPLE / "README.md").read_text()


def test_quickstart_names_the_fix_without_gsm8k(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "q"), "GSM8K_DIR": str(tmp_path / "nowhere")}
    proc = subprocess.run(["bash", str(REPO / "tools" / "quickstart.sh")], env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and "set GSM8K_DIR" in proc.stderr
