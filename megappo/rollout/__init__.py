"""Rollout engines: sampling parameters and completions shared by all engines, and the in-process `HFEngine`."""
from megappo.rollout.hf_engine import HFEngine
from megappo.rollout.sampling import Completion, SamplingParams, sample_next

__all__ = ["Completion", "HFEngine", "SamplingParams", "sample_next"]
