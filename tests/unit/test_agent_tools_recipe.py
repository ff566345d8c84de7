"""recipes/gsm8k/qwen3-8b_agent_tools.yaml (a GPU recipe: a Qwen3 agent program with a tool on GSM8K) as
`megappo train --print-config` checks and prints it: valid at its world size, the agent program and its tool config
found from the recipe's folder, GRPO without a critic. (Its agent program runs on CPU in
tests/e2e/test_openai_tool_agent_recipe_cpu.py.)"""
from __future__ import annotations

import yaml

from megappo.cli import main
from megappo.config.loader import RECIPES_DIR
from megappo.envs.registry import read_agent_config


def test_the_gsm8k_agent_tools_recipe_prints_its_config(capsys):
    assert main(["train", "--config", "gsm8k/qwen3-8b_agent_tools", "--print-config"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    arr = cfg["actor_rollout_ref"]
    assert arr["model"]["path"] == "~/models/Qwen3-8B" and arr["rollout"]["name"] == "sglang"
    agent = arr["rollout"]["agent"]
    assert agent["default_agent_loop"] == "gsm8k_tool_agent"
    assert agent["agent_loop_config_path"] == str(RECIPES_DIR / "gsm8k" / "agents" / "tools_openai.yaml")
    assert cfg["algorithm"]["adv_estimator"] == "grpo" and cfg["critic"]["enable"] is False
    assert arr["rollout"]["multi_turn"]["enable"] is False  # the agent runs its tools, not the built-in tool loop
    (entry,) = read_agent_config(agent["agent_loop_config_path"])
    assert entry["name"] == "gsm8k_tool_agent" and entry["agent"] == "tool_agent.py:solve"
    tool_config = RECIPES_DIR / "gsm8k" / "agents" / entry["kwargs"]["tool_config"]
    assert tool_config.resolve() == RECIPES_DIR / "tools" / "python_tool.yaml"
