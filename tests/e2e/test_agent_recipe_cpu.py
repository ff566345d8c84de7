"""recipes/cpu/tiny_openai_agent_ppo.yaml as a user runs it: the guess_number game played by an agent program on the
real `openai` client (recipes/cpu/agents/guess_agent.py) against megappo's endpoint. Every episode is one segment
(the agent extends its conversation), nothing fails, and the run repeats its golden metrics: each call's seed is its
own, so the batches the calls land in (which depend on when the agents call) change no number. The whole run
learns (reward +0.3 first five -> last five steps, validation too): the golden holds it, and the long tier runs it;
the default tier runs its first ten steps (2.6 s a step: 64 agents' `openai` clients share the trainer's process)."""
from __future__ import annotations

import shutil

import pytest

from megappo.testing import golden
from megappo.testing.recipes import learned, run_recipe
from megappo.trainer.metrics import read_rows

pytestmark = pytest.mark.e2e
RECIPE = "recipes/cpu/tiny_openai_agent_ppo.yaml"


def _run(tmp_path, guess_task_dir, *overrides: str) -> tuple[list[dict], list[dict]]:
    """The run's rows and their comparison with the golden's rows of the same steps."""
    out = tmp_path / "agent"
    shutil.copytree(guess_task_dir, out / "synthetic")  # the task's warm start, made once (tests/conftest.py)
    rows = run_recipe(RECIPE, out, *overrides, env=golden.GOLDEN_ENV)
    for r in rows[1:]:
        assert r["agent/error_fraction"] == r["agent/timeout_fraction"] == r["agent/no_call_fraction"] == 0.0
        assert r["agent/retokenized_fraction"] == 0.0 and r["agent/segments_per_episode"] == 1.0
        assert 1.0 <= r["agent/calls_per_episode"] <= 4.0 and r["env/reward_mean"] == r["reward/mean"]
        assert r["multi_turn/template_mismatch_fraction"] == 0.0
    header, want = golden.read("tiny_openai_agent_ppo")
    loose = golden.RUNS["tiny_openai_agent_ppo"].loose  # the engine's log-prob rounding in arrival-made batches
    got = golden.strip_machine_keys(read_rows(str(out)), loose)
    diff = golden.differences(got, want[:len(got)])
    if diff and header["cpu"] != golden.cpu_signature():
        pytest.skip(f"the golden was recorded on {header['cpu']!r}, whose floats differ from this CPU's: {diff[:2]}")
    assert not diff, "\n".join(diff)
    return rows, want


# long: the agent program's calls through the real openai client are tests/unit/test_agent_endpoint_runner.py's and
# the episode loop's recipe tests/e2e/test_env_recipe_cpu.py's; this is the recipe's golden (CI's 45 minutes)
@pytest.mark.long
def test_openai_agent_recipe_repeats_its_golden_first_steps(tmp_path, guess_task_dir):
    rows, want = _run(tmp_path, guess_task_dir, "trainer.total_training_steps=10")
    assert [r["step"] for r in rows] == list(range(11))
    val = [r["val/megappo/guess_number/reward_mean"] for r in rows if "val/megappo/guess_number/reward_mean" in r]
    assert len(val) == 2 and val[1] > val[0]
    # the recorded whole run learnt: +0.3 reward (first five -> last five steps) and validation
    assert learned(want) >= 0.3
    full = [r["val/megappo/guess_number/reward_mean"] for r in want if "val/megappo/guess_number/reward_mean" in r]
    assert full[-1] >= full[0] + 0.3


@pytest.mark.long
def test_openai_agent_recipe_learns_and_repeats_its_golden_metrics(tmp_path, guess_task_dir):
    rows, _ = _run(tmp_path, guess_task_dir)
    assert [r["step"] for r in rows] == list(range(41))
    assert learned(rows) >= 0.3, [r.get("reward/mean") for r in rows]
    val = [r["val/megappo/guess_number/reward_mean"] for r in rows if "val/megappo/guess_number/reward_mean" in r]
    assert len(val) == 5 and val[-1] >= val[0] + 0.3
