"""DAPO's dynamic sampling in the trainer (recipes/cpu/tiny_dapo.yaml with a small generation batch, so that a step
takes several): a run stopped after a step of several generation batches resumes exactly where the uninterrupted
run went on, and a step over algorithm.filter_groups.max_num_gen_batches stops the run naming the fix."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megappo.testing.prompts import assert_same_rows, read_metrics

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
BASE = ["data.gen_batch_size=16", "trainer.total_training_steps=3", "trainer.test_freq=-1", "trainer.logger=[]",
        "trainer.val_before_train=false", "data.synthetic.warm_start_steps=100"]


def _train(out: Path, *overrides: str) -> subprocess.CompletedProcess:
    home = out.parent / "home"
    home.mkdir(exist_ok=True)
    env = dict(os.environ, HOME=str(home), HF_HOME=str(home / "hf"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "megappo.cli", "train", "--config", "recipes/cpu/tiny_dapo.yaml",
           f"trainer.default_local_dir={out}", *BASE, *overrides]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


# long (CI's 45 minutes): a stop and resume continue exactly in tests/e2e/test_resume_exact.py (default tier); this
# adds a step that drew several generation batches (tiny_dapo's recipe test draws them in the default tier)
@pytest.mark.long
def test_resume_after_a_step_of_several_generation_batches_is_exact(tmp_path):
    ref = tmp_path / "uninterrupted"
    done = _train(ref, "trainer.save_freq=-1")
    assert done.returncode == 0, done.stderr[-4000:]
    rows = read_metrics(str(ref))
    first = rows[0]
    assert first["step"] == 1 and first["train/num_gen_batches"] >= 2 and first["filter_groups/num_dropped_groups"] > 0

    out = tmp_path / "stopped"
    stopped = _train(out, "trainer.save_freq=-1", "trainer.save_before_deadline=1")  # a deadline long past
    assert stopped.returncode == 75, stopped.stderr[-4000:]
    state = json.loads((out / "checkpoints" / "global_step_1" / "trainer_state.json").read_text())
    # the data position counts every generation batch step 1 took
    assert state["dataloader"]["batch_index"] == first["train/num_gen_batches"]
    resumed = _train(out, "trainer.save_freq=-1")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert_same_rows(rows, read_metrics(str(out)), ignore=("timing/", "perf/"))


def test_too_many_generation_batches_stop_the_run(tmp_path):
    proc = _train(tmp_path / "out", "algorithm.filter_groups.max_num_gen_batches=1", "trainer.save_freq=-1")
    assert proc.returncode == 3  # stopped on purpose
    assert "algorithm.filter_groups: step 1 generated 1 batches of 16 prompts (max_num_gen_batches=1)" in proc.stderr
    assert "Raise algorithm.filter_groups.max_num_gen_batches (0: no limit)" in proc.stderr
