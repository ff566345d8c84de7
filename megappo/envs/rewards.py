"""The reward of an episode whose environment scores it: `custom_reward_function: {path: megappo/envs/rewards.py,
name: env_reward}` (or a data_source's registered function that calls it). Imports nothing heavy (reward workers)."""
from __future__ import annotations

from typing import Any, Optional


def env_reward(data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None) -> float:
    """The sum of the episode's environment rewards (`EnvStep.reward`); 0.0 for a sample that was no episode."""
    return float((extra_info or {}).get("env_reward", 0.0))
