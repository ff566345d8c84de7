"""Running a recipe as a user does, for the end-to-end tests: `megappo train --config recipes/...` in a fresh process
from the repository root, with a HOME that holds nothing (no data, no models, no caches)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from megappo.trainer.metrics import one_per_step, read_steps

REPO = Path(__file__).resolve().parents[2]


def run_recipe(recipe: str, out: Path, *overrides: str, nproc: int = 1, timeout: float = 600,
               env: dict[str, str] | None = None) -> list[dict]:
    """Train `recipe` into `out` (one process, or torchrun with `nproc` ranks; `env` over the environment); its
    metrics, one row per step (a rolled-back attempt's row aside: `megappo.trainer.metrics.read_rows` has those).
    Asserts exit 0."""
    home = out.parent / "empty_home"
    home.mkdir(exist_ok=True)
    env = {**os.environ, "HOME": str(home), "HF_HOME": str(home / "hf"), "OMP_NUM_THREADS": "1", **(env or {})}
    train = ["train", "--config", recipe, f"trainer.default_local_dir={out}", *overrides]
    if nproc == 1:
        cmd = [sys.executable, "-m", "megappo.cli", *train]
    else:
        from megappo.testing.dist import free_port

        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               f"--master-port={free_port()}", "-m", "megappo.cli", *train]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return read_steps(str(out))


def learned(rows: list[dict], key: str = "reward/mean") -> float:
    """The mean of `key` over the last five steps minus that over the first five (step 0, validation, aside), each
    step counted once: by its last row, so a rolled-back attempt neither stands for its step nor adds one."""
    values = [r[key] for r in one_per_step(rows) if r["step"] > 0]
    assert len(values) >= 10
    return sum(values[-5:]) / 5 - sum(values[:5]) / 5
