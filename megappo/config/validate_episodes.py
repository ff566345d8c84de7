"""The rules of episodes (`actor_rollout_ref.rollout.multi_turn` and `rollout.agent`), run by
`megappo.checks`: each message names the key, what is wrong and the fix."""
from __future__ import annotations

import os

from megappo.config.fields import need as _need
from megappo.config.schema import MegappoConfig


def episode_errors(cfg: MegappoConfig, check_files: bool) -> list[str]:
    """Every violation of the tool loop's and the agents' rules."""
    errors: list[str] = []
    _check_multi_turn(cfg, errors, check_files)
    _check_agent(cfg, errors, check_files)
    return errors


def _check_multi_turn(cfg: MegappoConfig, errors: list[str], check_files: bool) -> None:
    mt, p = cfg.actor_rollout_ref.rollout.multi_turn, "actor_rollout_ref.rollout.multi_turn"
    if not mt.enable:
        return
    for key in ("max_assistant_turns", "max_user_turns"):
        value = getattr(mt, key)
        _need(errors, value is None or value >= 1, f"{p}.{key}", f"must be >= 1 or null, got {value}",
              "use null for no limit but response_length")
    _need(errors, mt.max_parallel_calls >= 1, f"{p}.max_parallel_calls", f"must be >= 1, got {mt.max_parallel_calls}",
          "use 1")
    _need(errors, mt.max_tool_response_length >= 1, f"{p}.max_tool_response_length",
          f"must be >= 1, got {mt.max_tool_response_length}", "use e.g. 256")
    frac = mt.max_tool_failure_fraction
    _need(errors, frac is None or 0 <= frac < 1, f"{p}.max_tool_failure_fraction",
          f"must be in [0, 1) or null, got {frac}", "use e.g. 0.5 (null: never stop for failing tools)")
    _need(errors, mt.max_tool_failure_steps >= 1, f"{p}.max_tool_failure_steps",
          f"must be >= 1, got {mt.max_tool_failure_steps}", "use e.g. 3")
    _need(errors, bool(mt.tool_config_path), f"{p}.tool_config_path", "is not set but multi_turn.enable is",
          "name a tool config YAML (verl's shape, see megappo/multi_turn/tools.py)")
    if check_files and mt.tool_config_path:
        _need(errors, os.path.isfile(os.path.expanduser(mt.tool_config_path)), f"{p}.tool_config_path",
              f"{mt.tool_config_path} does not exist", "give the path of the tool config YAML")


def _check_agent(cfg: MegappoConfig, errors: list[str], check_files: bool) -> None:
    agent, p = cfg.actor_rollout_ref.rollout.agent, "actor_rollout_ref.rollout.agent"
    _need(errors, agent.num_workers >= 1, f"{p}.num_workers", f"must be >= 1, got {agent.num_workers}", "use e.g. 64")
    _need(errors, agent.step_timeout_s is None or agent.step_timeout_s > 0, f"{p}.step_timeout_s",
          f"must be > 0 or null, got {agent.step_timeout_s}", "use e.g. 60")
    _need(errors, agent.deadline_s > 0, f"{p}.deadline_s", f"must be > 0, got {agent.deadline_s}", "use e.g. 300")
    mf = agent.max_failure_fraction
    _need(errors, mf is None or 0 <= mf < 1, f"{p}.max_failure_fraction", f"must be in [0, 1) or null, got {mf}",
          "use e.g. 0.5 (null: never stop)")
    _need(errors, agent.max_failure_steps >= 1, f"{p}.max_failure_steps", f"must be >= 1, got "
          f"{agent.max_failure_steps}", "use e.g. 3")
    _need(errors, not (agent.on_failure == "zero_reward" and cfg.reward_model.enable), f"{p}.on_failure",
          "zero_reward scores failed episodes 0 in place of the rule reward, but reward_model.enable scores them "
          "with the reward model", "use drop (the default) or keep")
    path = agent.agent_loop_config_path
    if check_files and path:
        _need(errors, os.path.isfile(os.path.expanduser(path)), f"{p}.agent_loop_config_path", f"{path} does not exist",
              "give the path of the agent config YAML (a list of {name, environment | agent, kwargs})")
