"""Rollout engines: the interface every engine implements (`base.RolloutEngine`), the registry by
`rollout.name` (`registry`), sampling parameters and completions shared by all engines, and the engines themselves.
Imported lazily: the config's checks load this package without torch."""
from typing import Any

__all__ = ["Completion", "HFEngine", "SamplingParams", "sample_next"]


def __getattr__(name: str) -> Any:
    if name == "HFEngine":
        from megappo.rollout.hf.engine import HFEngine

        return HFEngine
    if name in ("Completion", "SamplingParams", "sample_next"):
        from megappo.rollout import sampling

        return getattr(sampling, name)
    raise AttributeError(f"module 'megappo.rollout' has no attribute {name!r}")
