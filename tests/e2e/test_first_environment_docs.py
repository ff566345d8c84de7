"""docs/agents-and-environments.md's "Your first environment" runs as written: its shell blocks, in order, in a
fresh folder (beside links to the repository's megappo/ and recipes/, as from the repository root), with the
guess_number task already built (tests/conftest.py; the first block then reuses it instead of warm-starting for a
minute). The run trains on the environment: its reward, its own metric env/won, and no failed episodes."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megappo.trainer.metrics import read_steps

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]


def _script() -> str:
    page = (REPO / "docs" / "agents-and-environments.md").read_text()
    section = page[page.index("## Your first environment"):page.index("## Agents behind")]
    blocks = re.findall(r"^   ```bash\n(.*?)^   ```\n", section, re.S | re.M)
    assert len(blocks) == 4, blocks
    return "set -e\n" + "".join(re.sub(r"^   ", "", b, flags=re.M) for b in blocks)


def test_the_first_environment_steps_run_as_written(tmp_path, guess_task_dir):
    for name in ("megappo", "recipes"):
        (tmp_path / name).symlink_to(REPO / name)
    shutil.copytree(Path(guess_task_dir) / "guess_number", tmp_path / "first_env" / "base")
    bin_dir = Path(sys.executable).parent  # `python` and `megappo` as the user's shell finds them
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO), HOME=str(tmp_path))
    proc = subprocess.run(["bash", "-c", _script()], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    out = proc.stdout + proc.stderr
    assert "config OK" in out and "megappo: building" not in out  # the dry run; the task reused
    rows = read_steps(str(tmp_path / "outputs" / "first_env"))
    assert [r["step"] for r in rows] == list(range(21))
    train = [r for r in rows if r["step"] > 0]
    assert all(r["env/error_fraction"] == 0.0 and r["env/reward_mean"] == r["reward/mean"] for r in train)
    assert all(0.0 <= r["env/won"] <= 1.0 for r in train)
    first, last = (sum(r["reward/mean"] for r in part) / 5 for part in (train[:5], train[-5:]))
    assert last >= first + 0.05, [r["reward/mean"] for r in train]
