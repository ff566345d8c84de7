"""recipes/cpu/tiny_openai_agent_ppo.yaml as a user runs it: the guess_number game played by an agent program on the
real `openai` client (recipes/cpu/agents/guess_agent.py) against megappo's endpoint. The run learns (reward +0.3
first five -> last five steps, validation too), every episode is one segment (the agent extends its conversation),
nothing fails, and the run repeats its golden metrics: each call's seed is its own, so the batches the calls land
in (which depend on when the agents call) change no number."""
from __future__ import annotations

import pytest

from megappo.testing import golden
from megappo.testing.recipes import learned, run_recipe
from megappo.trainer.metrics import read_rows

pytestmark = pytest.mark.e2e


def test_openai_agent_recipe_learns_and_repeats_its_golden_metrics(tmp_path):
    out = tmp_path / "agent"
    rows = run_recipe("recipes/cpu/tiny_openai_agent_ppo.yaml", out, env=golden.GOLDEN_ENV)
    assert [r["step"] for r in read_rows(str(out))] == list(range(41))
    assert learned(rows) >= 0.3, [r.get("reward/mean") for r in rows]
    val = [r["val/megappo/guess_number/reward_mean"] for r in rows if "val/megappo/guess_number/reward_mean" in r]
    assert len(val) == 5 and val[-1] >= val[0] + 0.3
    for r in rows[1:]:
        assert r["agent/error_fraction"] == r["agent/timeout_fraction"] == r["agent/no_call_fraction"] == 0.0
        assert r["agent/retokenized_fraction"] == 0.0 and r["agent/segments_per_episode"] == 1.0
        assert 1.0 <= r["agent/calls_per_episode"] <= 4.0 and r["env/reward_mean"] == r["reward/mean"]
        assert r["multi_turn/template_mismatch_fraction"] == 0.0
    header, want = golden.read("tiny_openai_agent_ppo")
    loose = golden.RUNS["tiny_openai_agent_ppo"].loose  # the engine's log-prob rounding in arrival-made batches
    diff = golden.differences(golden.strip_machine_keys(read_rows(str(out)), loose), want)
    if diff and header["cpu"] != golden.cpu_signature():
        pytest.skip(f"the golden was recorded on {header['cpu']!r}, whose floats differ from this CPU's: {diff[:2]}")
    assert not diff, "\n".join(diff)
