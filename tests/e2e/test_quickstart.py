"""The README's main job, `tools/quickstart.sh`, end to end on real GSM8K and a tiny model (torchrun included)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
GSM8K = REPO.parent / "shared" / "data" / "gsm8k"


@pytest.mark.skipif(not (GSM8K / "train.jsonl").exists(), reason=f"GSM8K jsonl not found at {GSM8K}")
def test_quickstart_runs_every_stage(tmp_path):
    out = tmp_path / "quickstart"
    env = {**os.environ, "OUT": str(out), "GSM8K_DIR": str(GSM8K)}
    proc = subprocess.run(
        ["bash", str(REPO / "tools" / "quickstart.sh")], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.count("-> OK") == 3, proc.stdout  # TP1, TP2 (rank 0 prints) and the exported directory
    for path in ("data/train.parquet", "data/test.parquet", "mcore", "hf_export/config.json",
                 "hf_export/model.safetensors.index.json", "hf_export/tokenizer.json"):
        assert (out / path).exists(), path


def test_quickstart_names_the_fix_without_gsm8k(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "q"), "GSM8K_DIR": str(tmp_path / "nowhere")}
    proc = subprocess.run(["bash", str(REPO / "tools" / "quickstart.sh")], env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and "set GSM8K_DIR" in proc.stderr
