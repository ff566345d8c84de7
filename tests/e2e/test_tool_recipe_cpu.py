"""recipes/cpu/tiny_tool_ppo.yaml as a user runs it: multi-turn tool-calling PPO on the tool_sum task. The full run
must learn to call the calculator (reward up by >= 0.3 first five -> last five steps, tool calls per sample up) and
log the multi-turn metrics."""
from __future__ import annotations


import pytest

from megappo.testing.recipes import learned, run_recipe

pytestmark = pytest.mark.e2e
RECIPE = "recipes/cpu/tiny_tool_ppo.yaml"


def test_tool_recipe_learns(tmp_path):
    """~70 s on 2 cores (the warm start ~50 s of it), so it stays in the default suite."""
    rows = run_recipe(RECIPE, tmp_path / "tool_full")
    for key in ("multi_turn/turns_mean", "multi_turn/turns_max", "multi_turn/budget_hit_fraction",
                "tool/calls_per_sample", "tool/error_fraction", "tool/timeout_fraction", "tool/latency_s",
                "tool/calculator/calls_per_sample", "response/length_mean"):
        assert key in rows[-1], sorted(rows[-1])
    assert learned(rows) >= 0.3, [r.get("reward/mean") for r in rows]
    assert learned(rows, "tool/calls_per_sample") >= 0.3, [r.get("tool/calls_per_sample") for r in rows]
    # the only mismatches are turns with a stray byte token (invalid UTF-8: the message text cannot hold it)
    assert max(r["multi_turn/template_mismatch_fraction"] for r in rows if r["step"] > 0) <= 0.15
