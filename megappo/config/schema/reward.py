"""The configuration tree's reward sections: `reward_model` (a learned reward model, the judge, DAPO's overlong
shaping) and `custom_reward_function`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from megappo.config.schema.judge import JudgeConfig


@dataclass
class OverlongBufferConfig:
    """DAPO's overlong reward shaping (verl's DAPO reward manager): a response longer than
    data.max_response_length - len tokens loses penalty_factor * (length - (max_response_length - len)) / len, so
    the penalty grows linearly from 0 to penalty_factor over the last `len` tokens. Logged as
    reward/overlong_penalty_mean and reward/overlong_fraction; validation scores are not penalised."""

    enable: bool = False
    len: int = 0  # tokens of the buffer at the end of max_response_length; must be in (0, max_response_length]
    penalty_factor: float = 0.0  # the penalty of a response of max_response_length tokens
    log: bool = False  # accepted for verl compatibility: megappo logs the penalty metrics whenever enable


@dataclass
class RewardModelConfig:
    enable: bool = False  # score with a learned reward model (otherwise rule rewards only)
    path: Optional[str] = None  # reward model directory when enable is true
    micro_batch_size_per_gpu: Optional[int] = None  # reward model forward micro batch
    use_remove_padding: Optional[bool] = None  # packed forward (see ModelConfig); None: the actor's
    # Rule-reward batch scorer (megappo.rewards): how per-sample reward functions run in parallel.
    num_workers: int = 2  # worker processes (or Ray tasks in flight)
    backend: Literal["process", "ray", "serial"] = "process"  # serial: in the trainer process (debugging)
    timeout_s: float = 30.0  # per-sample limit; past it the sample gets failure_score
    failure_score: float = 0.0  # score of a sample whose reward function raised or timed out
    ray_address: Optional[str] = None  # ray backend: "auto" joins a running cluster; None starts a local one
    # Stop the run (naming the reward function) when more than this fraction of a step's samples fail to score
    # for max_failure_steps steps in a row, instead of training on failure_score. 1.0: never stop.
    max_failure_fraction: float = 0.5
    max_failure_steps: int = 3
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)  # rule rewards only
    # a generative judge instead of (or, per data source, beside) the rule rewards; not with enable
    judge: JudgeConfig = field(default_factory=JudgeConfig)


@dataclass
class CustomRewardFunctionConfig:
    path: Optional[str] = None  # Python file defining the function; None: the built-in registry by data_source
    name: str = "compute_score"  # fn(data_source, solution_str, ground_truth, extra_info) -> float | dict
