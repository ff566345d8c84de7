"""The `distillation` section: on-policy distillation from one or more frozen teachers (verl's `distillation.*`).

The student (the actor) samples as in PPO; a teacher scores the student's own tokens, and the per-token divergence
between the two is the learning signal: as a per-token advantage (`use_policy_gradient`, verl's default and
Thinking Machines' recipe: advantage -= coef * (log pi_student - log pi_teacher)), or as a loss term backpropagated
through the student (`use_policy_gradient: false`, GKD). With `use_task_rewards` the task's advantages stay and the
signal is added with weight `distillation_loss_coef`; without, the teacher alone teaches (the task reward is still
logged).

Where megappo differs from verl: a teacher runs either in megatron beside the reference (`backend: megatron`, the
actor's parallel layout, offloaded between uses on GPU) or on an engine of its own (`backend: engine`, verl's only
way: its `inference` section); several teachers, each for its data sources (`teacher_models`); top-k logit
distillation (`loss_mode: forward_kl_topk`) with a megatron teacher.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from megappo.config.schema.rollout import InferenceConfig

# per-token estimators of KL(student || teacher) on the student's sampled tokens (`megappo.algos.kl_penalty`), and
# the top-k forward KL(teacher || student) over the teacher's k most likely tokens (megatron teachers)
DistillLossMode = Literal["k1", "kl", "abs", "mse", "k2", "low_var_kl", "k3", "forward_kl_topk"]


@dataclass
class DistillationLossConfig:
    loss_mode: DistillLossMode = "k3"  # k1 with use_policy_gradient (the sampled reverse KL); k3/forward_kl_topk as a loss
    topk: int = 128  # forward_kl_topk: the teacher's top tokens per position
    use_task_rewards: bool = True  # false: the task reward is logged but not trained on
    distillation_loss_coef: float = 1.0  # the signal's weight beside the task's advantages (1.0 without them)
    loss_max_clamp: Optional[float] = 10.0  # each token's divergence clamped to [-max, max]; null: not clamped
    log_prob_min_clamp: Optional[float] = -10.0  # teacher and student log-probs clamped below first; null: not
    use_policy_gradient: bool = True  # the divergence as a per-token advantage (true) or a loss term (false)


@dataclass
class TeacherModelConfig:
    model_path: Optional[str] = None  # the teacher's Hugging Face directory (its tokenizer must be the student's)
    # megatron: built in the actor's parallel layout beside the reference (any TP/PP/EP the teacher's heads allow);
    # engine: served by `inference` (the in-process hf engine, or SGLang servers of its own), prompt log-probs only
    backend: Literal["megatron", "engine"] = "megatron"
    # the data sources whose samples this teacher scores (multi-teacher); empty: every one no other teacher names
    data_sources: list[str] = field(default_factory=list)
    inference: InferenceConfig = field(default_factory=InferenceConfig)  # backend=engine


@dataclass
class DistillationConfig:
    enabled: bool = False
    teacher_model: TeacherModelConfig = field(default_factory=TeacherModelConfig)  # the teacher named "teacher"
    # more teachers by name (megappo's key): {name: {model_path, backend, data_sources, inference}}, each with the
    # keys of teacher_model; metrics distill/<name>/*
    teacher_models: dict[str, Any] = field(default_factory=dict)
    distillation_loss: DistillationLossConfig = field(default_factory=DistillationLossConfig)
