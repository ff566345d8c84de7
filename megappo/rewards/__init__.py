"""Rule rewards: per-data_source reward functions, user functions from files, and a parallel batch scorer.

Importing this package does not import torch (reward worker processes import it); `RewardScorer`, `ScoreItem` and
`ScoreResult` load `megappo.rewards.scorer` on first use.
"""
from megappo.rewards.registry import (
    CustomRewardFn,
    RewardFunctionError,
    default_compute_score,
    get_reward_fn,
    load_custom_reward_fn,
    register_reward,
    registered_data_sources,
)

_LAZY = {"RewardScorer", "ScoreItem", "ScoreResult"}

__all__ = [
    "CustomRewardFn",
    "RewardFunctionError",
    "RewardScorer",
    "ScoreItem",
    "ScoreResult",
    "default_compute_score",
    "get_reward_fn",
    "load_custom_reward_fn",
    "register_reward",
    "registered_data_sources",
]


def __getattr__(name: str):
    if name in _LAZY:
        from megappo.rewards import scorer

        return getattr(scorer, name)
    raise AttributeError(f"module 'megappo.rewards' has no attribute {name!r}")
