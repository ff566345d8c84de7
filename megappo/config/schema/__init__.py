"""The configuration tree: every option megappo reads, with its single default; `MegappoConfig` is its root.

Names, nesting and meanings follow verl's `ppo_megatron_trainer.yaml`, so a verl command line carries over
(`actor_rollout_ref.actor.use_kl_loss=true algorithm.kl_ctrl.type=adaptive`). Recipes under `recipes/` and
command-line overrides only change values here; they never add keys.

One file per section: `data.py`, `model.py` (model, LoRA, optimiser and parallel layout, shared by the roles),
`actor.py` (actor_rollout_ref), `rollout.py`, `critic.py`, `reward.py` (reward_model, custom_reward_function),
`judge.py`, `algorithm.py`, `trainer.py` (trainer, async_training), `distill.py`; every dataclass is importable
from here.

A field left `None` with a "resolved" comment is filled from another field by `megappo.config.derived.resolve`,
the one place derived defaults live. Everything else is plain data: no imports of torch or megatron.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megappo.config.fields import DType, KLKind, LossAggMode
from megappo.config.schema.actor import ActorConfig, ActorRolloutRefConfig, PolicyLossConfig, RefConfig
from megappo.config.schema.algorithm import (AlgorithmConfig, CustomFunctionConfig, FilterGroupsConfig, KLCtrlConfig,
                                             RolloutCorrectionConfig)
from megappo.config.schema.critic import CriticConfig
from megappo.config.schema.data import DataConfig, SyntheticTaskConfig
from megappo.config.schema.distill import DistillationConfig
from megappo.config.schema.judge import JudgeConfig
from megappo.config.schema.model import LoRAConfig, MegatronConfig, ModelConfig, OptimConfig, RouterReplayConfig
from megappo.config.schema.reward import CustomRewardFunctionConfig, OverlongBufferConfig, RewardModelConfig
from megappo.config.schema.rollout import MultiTurnConfig, RolloutConfig, ValKwargsConfig
from megappo.config.schema.trainer import AsyncTrainingConfig, GuardConfig, TrainerConfig

__all__ = ["ActorConfig", "ActorRolloutRefConfig", "AlgorithmConfig", "AsyncTrainingConfig", "CriticConfig",
           "CustomFunctionConfig", "CustomRewardFunctionConfig", "DType", "DataConfig", "DistillationConfig",
           "FilterGroupsConfig", "GuardConfig", "JudgeConfig", "KLCtrlConfig", "KLKind", "LoRAConfig", "LossAggMode",
           "MegappoConfig", "MegatronConfig",
           "ModelConfig", "MultiTurnConfig", "OptimConfig", "OverlongBufferConfig", "PolicyLossConfig", "RefConfig",
           "RewardModelConfig", "RolloutConfig", "RolloutCorrectionConfig", "RouterReplayConfig",
           "SyntheticTaskConfig", "TrainerConfig", "ValKwargsConfig"]


@dataclass
class MegappoConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    distillation: DistillationConfig = field(default_factory=DistillationConfig)
