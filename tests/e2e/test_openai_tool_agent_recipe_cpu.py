"""recipes/cpu/tiny_openai_tool_agent_ppo.yaml as a user runs it: the tool_sum task played by an agent program on the
real `openai` client (recipes/cpu/agents/calculator_agent.py) that passes tools=[calculator], runs the returned
tool_calls itself and sends their results back as "tool" messages. The endpoint turns the model's hermes calls into
OpenAI tool calls and continues each episode in one segment; the run trains on it: more calls, more reward (0.16 ->
0.67 in three steps, measured on 2 shared cores, ~2.5 s a step after the session's warm start)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from megappo.testing.recipes import run_recipe

pytestmark = pytest.mark.e2e
RECIPE = "recipes/cpu/tiny_openai_tool_agent_ppo.yaml"


def test_openai_tool_agent_recipe_calls_the_tool_and_trains(tmp_path, tool_task_dir):
    out = tmp_path / "tool_agent"
    shutil.copytree(tool_task_dir, out / "synthetic")  # the task's warm start, made once (tests/conftest.py)
    rows = run_recipe(RECIPE, out, "trainer.total_training_steps=4", "trainer.val_before_train=false",
                      "trainer.test_freq=-1", "trainer.save_freq=-1")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["agent/error_fraction"] == r["agent/timeout_fraction"] == r["agent/no_call_fraction"] == 0.0
        # the agent's tool messages extend the conversation the endpoint recorded: one segment, nothing retokenized
        assert r["agent/segments_per_episode"] == 1.0 and r["agent/retokenized_fraction"] == 0.0
        assert r["env/reward_mean"] == r["reward/mean"]  # the agent's reward
        # tool calls happened: the agent ran them (its own metrics) and called the model again with their results
        assert r["env/calculator_calls"] > 0 and r["agent/calls_per_episode"] > 1.0
    calls = [r["env/calculator_calls"] for r in rows]
    reward = [r["reward/mean"] for r in rows]
    assert calls[-1] >= calls[0] + 0.2, calls  # PPO learns that calling pays
    assert reward[-1] >= reward[0] + 0.2, reward


def test_the_gsm8k_tool_agent_runs_its_tool_config_on_cpu(tmp_path, tool_task_dir):
    """recipes/gsm8k/qwen3-8b_agent_tools.yaml's agent program (recipes/gsm8k/agents/tool_agent.py: any verl tool
    config, a GSM8K-scored answer) on the tiny tool task with the calculator's tool config: the tools it builds from
    the config answer the model's calls and their metrics are logged. Its reward is GSM8K's ("####"), which the tiny
    model never writes: 0 (a verdict, not a failure of the agent)."""
    repo = Path(__file__).resolve().parents[2]
    agents = tmp_path / "agents.yaml"
    agents.write_text(f"- name: calculator_agent\n  agent: {repo / 'recipes/gsm8k/agents/tool_agent.py'}:solve\n"
                      f"  kwargs: {{tool_config: {repo / 'recipes/cpu/tools/calculator.yaml'}, max_turns: 3, "
                      "max_tokens: 32}\n")
    out = tmp_path / "gsm8k_agent"
    shutil.copytree(tool_task_dir, out / "synthetic")
    rows = run_recipe(RECIPE, out, "trainer.total_training_steps=1", "trainer.val_before_train=false",
                      "trainer.test_freq=-1", "trainer.save_freq=-1",
                      f"actor_rollout_ref.rollout.agent.agent_loop_config_path={agents}")
    (r,) = rows
    assert r["agent/error_fraction"] == r["agent/timeout_fraction"] == 0.0
    assert r["env/tool_calls"] > 0 and r["env/tool_errors"] == 0.0 and r["env/turns"] > 1.0
    assert r["env/reward_mean"] == 0.0
