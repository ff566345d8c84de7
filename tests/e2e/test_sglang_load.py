"""A real SGLang server loads what `megappo convert mcore-to-hf` writes, as it is, and generates the same greedy
tokens as `transformers` (tools/sglang/check.py, run with SGLang's own python).

SGLang needs its own environment (it pins other versions of torch and transformers than megappo's). On CPU the
session builds one with tools/sglang/install_cpu.sh into $MEGAPPO_SGLANG_VENV (default
~/.cache/megappo/sglang-cpu-<hash of the install files>) and reuses it on later runs; $MEGAPPO_SGLANG_PYTHON
points at an existing SGLang python instead (a GPU machine's).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.sglang]
TOOLS = Path(__file__).resolve().parents[2] / "tools" / "sglang"


def _install_hash() -> str:
    h = hashlib.sha256()
    for name in ("install_cpu.sh", "requirements-cpu.txt", "sgl_kernel_stub.py", "patch_torchvision.py"):
        h.update((TOOLS / name).read_bytes())
    return h.hexdigest()[:12]


@pytest.fixture(scope="session")
def sglang_python() -> str:
    if os.environ.get("MEGAPPO_SGLANG_PYTHON"):
        return os.environ["MEGAPPO_SGLANG_PYTHON"]
    venv = Path(os.environ.get("MEGAPPO_SGLANG_VENV")
                or Path.home() / ".cache" / "megappo" / f"sglang-cpu-{_install_hash()}")
    ready = venv / ".megappo-ready"
    if not ready.exists():
        proc = subprocess.run(["bash", str(TOOLS / "install_cpu.sh"), str(venv)], capture_output=True, text=True,
                              timeout=1200)
        assert proc.returncode == 0, f"building the SGLang venv failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        ready.write_text("ok\n")
    return str(venv / "bin" / "python")


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_sglang_serves_the_exported_checkpoint(sglang_python, hf_model_dir, tmp_path, family):
    from megappo.convert.hf_to_mcore import hf_to_mcore
    from megappo.convert.mcore_to_hf import mcore_to_hf

    hf_to_mcore(hf_model_dir(family), str(tmp_path / "mcore"), progress=False)
    export = str(tmp_path / "export")
    mcore_to_hf(str(tmp_path / "mcore"), export, progress=False)
    proc = subprocess.run([sglang_python, str(TOOLS / "check.py"), "--hf", export, "--max-new-tokens", "12"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": ""})
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "4/4 prompts identical" in proc.stdout
