"""recipes/cpu/tiny_tool_ppo.yaml as a user runs it: multi-turn tool-calling PPO on the tool_sum task. The full run
must learn to call the calculator (reward up by >= 0.3 first five -> last five steps, tool calls per sample up) and
log the multi-turn metrics."""
from __future__ import annotations


import shutil

import pytest

from megappo.testing.recipes import learned, run_recipe

pytestmark = pytest.mark.e2e
RECIPE = "recipes/cpu/tiny_tool_ppo.yaml"


@pytest.fixture(scope="module")
def tool_task(tool_task_dir) -> str:
    """The recipe's `synthetic/` folder (the tool task, warm-started once a session, tests/conftest.py): each run
    copies it and reuses it."""
    return tool_task_dir


def test_tool_recipe_learns(tmp_path, tool_task):
    shutil.copytree(tool_task, tmp_path / "tool_full" / "synthetic")
    rows = run_recipe(RECIPE, tmp_path / "tool_full")
    for key in ("multi_turn/turns_mean", "multi_turn/turns_max", "multi_turn/budget_hit_fraction",
                "tool/calls_per_sample", "tool/error_fraction", "tool/timeout_fraction", "tool/latency_s",
                "tool/calculator/calls_per_sample", "response/length_mean"):
        assert key in rows[-1], sorted(rows[-1])
    assert learned(rows) >= 0.3, [r.get("reward/mean") for r in rows]
    assert learned(rows, "tool/calls_per_sample") >= 0.3, [r.get("tool/calls_per_sample") for r in rows]
    # the only mismatches are turns with a stray byte token (invalid UTF-8: the message text cannot hold it)
    assert max(r["multi_turn/template_mismatch_fraction"] for r in rows if r["step"] > 0) <= 0.15


def test_a_broken_tool_stops_the_run(tmp_path, tool_task):
    """A calculator whose execute raises, named by a file path beside its tool config, run from another
    directory: the console says what the tool raised, and the run stops with exit 3 once more than half the calls
    failed for 3 steps in a row."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "broken.py").write_text("from megappo.multi_turn.calculator import CalculatorTool\n\n"
                                     "class Broken(CalculatorTool):\n    def execute(self, instance_id, arguments):\n"
                                     "        raise RuntimeError('the calculator is broken')\n")
    config = (repo / "recipes/cpu/tools/calculator.yaml").read_text()
    (tools / "calculator.yaml").write_text(config.replace("megappo.multi_turn.calculator.CalculatorTool",
                                                          "broken.py:Broken"))
    shutil.copytree(tool_task, tmp_path / "out" / "synthetic")
    proc = subprocess.run(
        [sys.executable, "-m", "megappo.cli", "train", "--config", str(repo / RECIPE),
         f"trainer.default_local_dir={tmp_path / 'out'}", f"actor_rollout_ref.rollout.multi_turn.tool_config_path="
         f"{tools / 'calculator.yaml'}", "trainer.val_before_train=false", "trainer.test_freq=-1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(repo)))
    err = proc.stderr
    assert proc.returncode == 3, (proc.stdout + err)[-6000:]
    assert err.count("WARNING: tool 'calculator' raised an exception: the tool calculator failed: RuntimeError: "
                     "the calculator is broken") == 1, err[-6000:]
    assert "the tool itself failed on more than actor_rollout_ref.rollout.multi_turn.max_tool_failure_fraction=0.5 " \
           "of the calls for 3 steps in a row" in err, err[-6000:]
