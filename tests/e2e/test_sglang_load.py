"""A real SGLang server loads what `megappo convert mcore-to-hf` writes, as it is, and generates the same greedy
tokens as `transformers` (tools/sglang/check.py, run with SGLang's own python).

SGLang runs in its own environment: see the `sglang_python` fixture in conftest.py.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.sglang]
TOOLS = Path(__file__).resolve().parents[2] / "tools" / "sglang"


# the MoE conversion itself is tested without SGLang (tests/unit/test_convert*.py, multirank); here qwen2 by default
@pytest.mark.parametrize("family", ["qwen2", pytest.param("qwen3_moe", marks=pytest.mark.long)])
def test_sglang_serves_the_exported_checkpoint(sglang_python, hf_model_dir, tmp_path, family):
    from megappo.kinds.commands import hf_to_mcore, mcore_to_hf

    hf_to_mcore(hf_model_dir(family), str(tmp_path / "mcore"), progress=False)
    export = str(tmp_path / "export")
    mcore_to_hf(str(tmp_path / "mcore"), export, progress=False)
    proc = subprocess.run([sglang_python, str(TOOLS / "check.py"), "--hf", export, "--max-new-tokens", "12"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": ""})
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "4/4 prompts identical" in proc.stdout
