"""The configuration tree's `actor_rollout_ref` section: the actor, its policy loss and the reference (the rollout
engine's section is `rollout.py`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from megappo.config.fields import KLKind, LossAggMode
from megappo.config.schema.model import MegatronConfig, ModelConfig, OptimConfig
from megappo.config.schema.rollout import RolloutConfig


@dataclass
class PolicyLossConfig:
    """verl's `actor.policy_loss` (megappo/algos/policy_losses.py)."""

    # vanilla (PPO clip + dual clip), gspo, cispo, sapo, clip_cov, kl_cov, geo_mean, gpg, dppo_tv, dppo_kl (clip
    # ratios: probability-change bounds; clip_ratio_c truncates the ratio), dro (dro_beta); or a user's `name`
    loss_mode: str = "vanilla"
    clip_cov_ratio: float = 0.0002  # clip_cov: fraction of tokens whose gradient is cut
    clip_cov_lb: float = 1.0  # clip_cov: covariance range of the candidates
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002  # kl_cov: fraction of tokens that get the KL penalty
    ppo_kl_coef: float = 0.1  # kl_cov: that penalty's coefficient
    dro_beta: Optional[float] = None  # dro: the quadratic log-ratio penalty's coefficient (required, > 0)
    path: Optional[str] = None  # a user's loss: the .py file
    name: Optional[str] = None  # and the function in it, registered under this name (set loss_mode to it)
    # Train the policy gradient on this fraction of the step's response tokens with the highest entropy under the
    # old policy (Wang et al. 2025's forking tokens: 0.2); the others' policy loss is zeroed, the KL loss and the
    # entropy bonus keep every token. 1.0: all tokens (megappo/algos/token_selection.py).
    top_entropy_quantile: float = 1.0


@dataclass
class ActorConfig:
    strategy: Literal["megatron"] = "megatron"  # accepted for verl compatibility; megatron is the only backend
    # Prompts per optimiser step; each prompt brings rollout.n responses, so a mini-batch has
    # ppo_mini_batch_size * rollout.n samples, split over the data-parallel ranks.
    ppo_mini_batch_size: int = 256
    ppo_micro_batch_size_per_gpu: Optional[int] = None  # samples per forward/backward; None: whole local mini-batch
    use_dynamic_bsz: bool = False  # pack micro-batches by token count instead of sample count
    ppo_max_token_len_per_gpu: int = 16384  # token budget of one packed micro-batch (use_dynamic_bsz)
    ppo_epochs: int = 1  # passes over each rollout batch
    shuffle: bool = False  # shuffle samples between mini-batches of a rollout batch
    data_loader_seed: Optional[int] = None  # seed of that shuffle; None: data.seed
    clip_ratio: float = 0.2  # PPO clip range; the default for clip_ratio_low/high
    clip_ratio_low: Optional[float] = None  # resolved: clip_ratio
    clip_ratio_high: Optional[float] = None  # resolved: clip_ratio (raise it for DAPO's clip-higher)
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages; must be > 1
    loss_agg_mode: LossAggMode = "token-mean"  # how token losses become one number
    # seq-mean-token-sum-norm's divisor (Dr. GRPO's constant); None: data.max_response_length
    loss_scale_factor: Optional[float] = None
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    tau_pos: float = 1.0  # sapo: gate temperature of tokens with a positive advantage
    tau_neg: float = 1.05  # sapo: and of the others
    entropy_coeff: float = 0.0  # weight of the entropy bonus
    use_kl_loss: bool = False  # add kl_loss_coef * KL(actor || ref) to the policy loss (GRPO style)
    kl_loss_coef: float = 0.001
    kl_loss_type: KLKind = "low_var_kl"
    # vision-language models: keep the vision tower and its patch merger fixed (verl's name; on by default here)
    freeze_vision_tower: bool = True
    optim: OptimConfig = field(default_factory=OptimConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)


@dataclass
class RefConfig:
    strategy: Literal["megatron"] = "megatron"
    log_prob_micro_batch_size_per_gpu: Optional[int] = None  # samples per forward; None: whole local batch
    log_prob_use_dynamic_bsz: Optional[bool] = None  # resolved: actor.use_dynamic_bsz
    log_prob_max_token_len_per_gpu: Optional[int] = None  # resolved: actor.ppo_max_token_len_per_gpu
    megatron: MegatronConfig = field(default_factory=MegatronConfig)


@dataclass
class ActorRolloutRefConfig:
    hybrid_engine: bool = True  # actor and rollout share GPUs, weights are resharded between phases
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
