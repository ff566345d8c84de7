"""The configuration tree's `critic` section: the value model."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from megappo.config.fields import LossAggMode
from megappo.config.schema.model import MegatronConfig, ModelConfig, OptimConfig


def _critic_optim() -> OptimConfig:
    return OptimConfig(lr=1e-5)


@dataclass
class CriticConfig:
    enable: Optional[bool] = None  # resolved: true when algorithm.adv_estimator needs one (gae)
    strategy: Literal["megatron"] = "megatron"
    model: ModelConfig = field(default_factory=ModelConfig)  # path resolved: actor_rollout_ref.model.path
    optim: OptimConfig = field(default_factory=_critic_optim)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    ppo_mini_batch_size: Optional[int] = None  # resolved: actor.ppo_mini_batch_size (prompts)
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    use_dynamic_bsz: Optional[bool] = None  # resolved: actor.use_dynamic_bsz
    ppo_max_token_len_per_gpu: int = 32768
    forward_max_token_len_per_gpu: Optional[int] = None  # resolved: critic.ppo_max_token_len_per_gpu
    ppo_epochs: Optional[int] = None  # resolved: actor.ppo_epochs
    shuffle: Optional[bool] = None  # resolved: actor.shuffle
    cliprange_value: float = 0.5  # value clip range around the old values
    loss_agg_mode: Optional[LossAggMode] = None  # resolved: actor.loss_agg_mode
