"""The configuration tree's `algorithm` section: the advantage estimator, the KL controller, DAPO's group
filter and verl's rollout correction (megappo/algos/)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from megappo.config.fields import KLKind


@dataclass
class KLCtrlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"  # adaptive: Ziegler et al. proportional controller
    kl_coef: float = 0.001  # coefficient of the in-reward KL penalty (the initial one when adaptive)
    target_kl: float = 0.1  # adaptive only: the KL the controller steers to
    horizon: int = 10000  # adaptive only: samples over which the coefficient moves by the clipped error


@dataclass
class RolloutCorrectionConfig:
    """Off-policy correction between the rollout engine's policy (the log-probs it reported) and the trainer's old
    policy (recomputed), as verl 0.9.1's `algorithm.rollout_correction` (megappo/algos/rollout_correction.py). The
    gap is an older policy (async_training) or the engine's own kernels and precision. `rollout_corr/*` diagnostics
    (KL, perplexity ratio, chi-square) are logged every step whether or not a correction is on."""

    rollout_is: Optional[Literal["token", "sequence"]] = None  # importance weights old / rollout, per token or row
    # a number or "U": truncated IS (weights capped at U); "L_U": IcePop (weights outside [L, U] set to 0)
    rollout_is_threshold: Union[float, str, None] = 2.0
    rollout_is_batch_normalize: bool = False  # divide the weights by their batch mean
    # rejection sampling: comma-separated tests a token (or its row) must pass, e.g. "seq_mean_k1", "token_k3";
    # each of token_kN, seq_sum_kN, seq_mean_kN (N = 1, 2, 3) and seq_max_k2, seq_max_k3
    rollout_rs: Optional[str] = None
    rollout_rs_threshold: Union[float, str, None] = None  # one bound for every test, or one per test, comma-separated
    # true: no recompute, old log-probs are the rollout's and the correction runs inside the loss (loss_type)
    bypass_mode: bool = False
    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"  # bypass_mode only
    # one of verl's named presets (docs/algorithms.md; megappo/config/rollout_presets.py), e.g.
    # decoupled_geo_rs_seq_tis: the section starts from its fields, and the keys above set in the same recipe or
    # command line override them
    preset: Optional[str] = None


@dataclass
class CustomFunctionConfig:
    """A function of a user's Python file, registered under its `name` (then selected by that name)."""

    path: Optional[str] = None  # the .py file; None: none
    name: Optional[str] = None  # the function's name in it, and the name it is registered under


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling (verl's `algorithm.filter_groups`, megappo/trainer/dynamic_sampling.py): a prompt
    whose rollout.n responses all have the same `metric` teaches a group-relative estimator nothing, so its group is
    dropped and more generation batches (data.gen_batch_size prompts each) are generated and scored until
    data.train_batch_size prompts are kept; the surplus of the last batch is dropped. Sync rollouts only."""

    enable: bool = False
    # what must vary within a group: reward (the sequence score the advantages see: the rule reward plus the
    # overlong penalty, before any in-reward KL; seq_reward is the same), seq_final_reward (after the in-reward KL),
    # score (the reward function's score alone), acc (its "acc" entry; a function returning a float: that float),
    # or the name of any other numeric entry the reward function returns
    metric: str = "reward"
    max_num_gen_batches: int = 0  # generation batches one step may take before the run stops; <= 0: no limit


@dataclass
class AlgorithmConfig:
    gamma: float = 1.0  # discount factor for GAE
    lam: float = 1.0  # GAE lambda (bias/variance trade-off)
    # a name of megappo.algos.estimators (docs/algorithms.md's table): gae (needs a critic), grpo, rloo,
    # reinforce_plus_plus, reinforce_plus_plus_baseline, remax, opo, gpg, grpo_passk, grpo_vectorized,
    # rloo_vectorized, gdpo (with gdpo_reward_keys), optimal_token_baseline, tir_optimal_token_baseline (not with
    # rollout_correction's bypass_mode); or custom_adv_estimator.name
    adv_estimator: str = "gae"
    # grpo / grpo_passk: divide by the group std (false + loss_agg_mode=seq-mean-token-sum-norm: Dr. GRPO)
    norm_adv_by_std_in_grpo: bool = True
    custom_adv_estimator: CustomFunctionConfig = field(default_factory=CustomFunctionConfig)
    use_kl_in_reward: bool = False  # subtract kl_ctrl.kl_coef * KL(actor || ref) from the token rewards
    kl_penalty: KLKind = "kl"  # the KL estimator used for the in-reward penalty
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    # gdpo: keys of the dict the rule reward function returns, each normalised within the group (required)
    gdpo_reward_keys: Optional[list[str]] = None
    gdpo_reward_weights: Optional[list[float]] = None  # gdpo: one weight per key; None: all 1
