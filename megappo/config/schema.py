"""The configuration tree: every option megappo reads, with its single default.

Names, nesting and meanings follow verl's `ppo_megatron_trainer.yaml`, so a verl command line carries over
(`actor_rollout_ref.actor.use_kl_loss=true algorithm.kl_ctrl.type=adaptive`). Recipes under `recipes/` and
command-line overrides only change values here; they never add keys.

The rollout section's dataclasses are in `schema_rollout.py`, the trainer's and async_training's in
`schema_trainer.py`, distillation's in `schema_distill.py`; every one is importable from here.

A field left `None` with a "resolved" comment is filled from another field by `megappo.config.derived.resolve`,
the one place derived defaults live. Everything else is plain data: no imports of torch or megatron.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from megappo.config.fields import DType, KLKind, LossAggMode
from megappo.config.schema_distill import DistillationConfig
from megappo.config.schema_judge import JudgeConfig
from megappo.config.schema_rollout import MultiTurnConfig, RolloutConfig, ValKwargsConfig
from megappo.config.schema_trainer import AsyncTrainingConfig, GuardConfig, TrainerConfig

__all__ = ["ActorConfig", "ActorRolloutRefConfig", "AlgorithmConfig", "AsyncTrainingConfig", "CriticConfig",
           "CustomFunctionConfig", "CustomRewardFunctionConfig", "DType", "DataConfig", "DistillationConfig",
           "FilterGroupsConfig", "GuardConfig", "JudgeConfig", "KLCtrlConfig", "KLKind", "LoRAConfig", "LossAggMode",
           "MegappoConfig", "MegatronConfig",
           "ModelConfig", "MultiTurnConfig", "OptimConfig", "OverlongBufferConfig", "PolicyLossConfig", "RefConfig",
           "RewardModelConfig", "RolloutConfig", "RolloutCorrectionConfig", "SyntheticTaskConfig", "TrainerConfig",
           "ValKwargsConfig"]


# ----------------------------------------------------------------------------------------------------------------
# algorithm
# ----------------------------------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------------------------------
# models, optimisers and parallel layouts (shared by actor, ref and critic)
# ----------------------------------------------------------------------------------------------------------------
def _lora_targets() -> list[str]:
    return ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


@dataclass
class LoRAConfig:
    """LoRA adapters over a frozen base (verl's megatron `model.lora`; megappo/models/lora/). The reference policy
    is the actor with its adapters off; checkpoints hold the adapters and their optimizer state only."""

    type: Literal["lora"] = "lora"
    rank: int = 0  # > 0 enables LoRA
    alpha: float = 32.0  # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0  # on the adapter's input
    dropout_position: Literal["pre"] = "pre"
    # megatron linear layers that get adapters (dense and MoE experts alike)
    target_modules: list[str] = field(default_factory=_lora_targets)
    # module names (or name suffixes, e.g. "decoder.layers.0.self_attention.linear_qkv") left without adapters
    exclude_modules: list[str] = field(default_factory=list)
    lora_A_init_method: Literal["xavier", "kaiming"] = "xavier"
    lora_B_init_method: Literal["zero"] = "zero"  # B = 0: training starts from the base model exactly
    # the weight sync always sends merged weights (W + alpha/rank * B A) of the adapted layers; accepted for verl
    merge: bool = False
    adapter_path: Optional[str] = None  # a PEFT adapter directory to start the adapters from
    # critic.model.lora only (megappo's key; verl has none): the critic's frozen base is the actor's own tensors (one
    # copy of the base in memory) under the critic's adapters and value head. Needs critic.model.path, dtype and
    # override_config equal to the actor's and LoRA on both
    share_actor_base: bool = False


@dataclass
class ModelConfig:
    path: Optional[str] = None  # Hugging Face model directory (config.json + safetensors); required
    tokenizer_path: Optional[str] = None  # resolved: the model path
    dtype: Optional[DType] = None  # None: bfloat16 on GPU, float32 on CPU
    trust_remote_code: bool = False  # let transformers run code shipped with the model
    enable_gradient_checkpointing: bool = False  # recompute activations in backward to save memory
    override_config: dict[str, Any] = field(default_factory=dict)  # keys set on the HF config before building
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # critic.model.lora: a LoRA critic (adapters + value head)
    # verl's name: run packed micro-batches (sequences concatenated without padding, megatron's THD format) where
    # the attention supports it (megappo's SDPA local spec on CPU, transformer-engine on GPU); equal to the padded
    # path to float summation order. None: true for actor_rollout_ref.model, the actor's value for critic.model
    use_remove_padding: Optional[bool] = None
    # Prefix sharing: a packed micro-batch runs a prompt shared by several rows (GRPO groups of rollout.n) once,
    # each response attending to the prompt and itself only (megappo.models.layout.prefix; under context
    # parallelism a group is one tree row, megappo.models.layout.prefix_cp); exact against the unshared path.
    # None (automatic): on where the model can (megappo's SDPA attention with plain rope, packed or context
    # parallel, no router replay) and sharing prompts of >= 64 tokens drops >= 25% of a batch's tokens (prompt 1024,
    # responses 64-256, n 8: 3.3x; where under ~15% is saved it is slower: long responses, short prompts; see
    # megappo.models.layout.prefix.MIN_SAVED_FRACTION); true: wherever a prompt repeats (an error where the model
    # cannot); false: never. critic.model's None: the actor's
    use_prefix_sharing: Optional[bool] = None


@dataclass
class OptimConfig:
    optimizer: Literal["adam"] = "adam"  # AdamW (decoupled weight decay), as megatron-core builds it
    lr: float = 1e-6
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.01
    clip_grad: float = 1.0  # global gradient-norm clip
    lr_warmup_steps: Optional[int] = None  # linear warmup steps; None or <= 0 uses lr_warmup_steps_ratio
    lr_warmup_steps_ratio: float = 0.0  # warmup as a fraction of the total training steps
    lr_scheduler: Literal["constant", "cosine"] = "constant"  # schedule after warmup
    min_lr_ratio: float = 0.0  # cosine only: the final lr as a fraction of lr


@dataclass
class RouterReplayConfig:
    """verl's `megatron.router_replay` (MoE; read on the actor's, megappo/models/router_replay.py): which routes
    the trainer's routers follow. disabled: their own. R3: the rollout engine's (needs
    rollout.enable_rollout_routing_replay), for the old and reference log-probs and the update. R2: the trainer's
    own from its first pass over the step's samples (the old log-probs), replayed in the reference pass and the
    update."""

    mode: Literal["disabled", "R2", "R3"] = "disabled"


@dataclass
class MegatronConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None  # interleaved pipeline chunks per pp rank
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None  # None: same as tensor_model_parallel_size
    context_parallel_size: int = 1
    sequence_parallel: bool = False  # needs tp > 1 and transformer-engine norms (not on CPU)
    param_offload: bool = False  # keep parameters in host memory between phases
    grad_offload: bool = False  # keep gradients in host memory between phases
    optimizer_offload: bool = False  # keep optimizer states in host memory between phases
    use_distributed_optimizer: bool = False  # shard optimizer states over data-parallel ranks (ZeRO-1)
    seed: int = 42  # model-parallel RNG seed
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)


# ----------------------------------------------------------------------------------------------------------------
# actor_rollout_ref
# ----------------------------------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------------------------------
# critic
# ----------------------------------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------------------------------
# data and rewards
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class SyntheticTaskConfig:
    """A built-in verifiable task that needs no files: before anything else the trainer writes a tiny model (with a
    short supervised warm start) and its train/val prompt sets under `<trainer.default_local_dir>/synthetic/`, and
    points actor_rollout_ref.model.path, data.train_files and data.val_files at them. Deterministic in `seed`."""

    name: Optional[str] = None  # None: off; a task of megappo.tasks (e.g. the main CPU job's)
    num_train_prompts: int = 1024
    num_val_prompts: int = 64
    warm_start_steps: int = 200  # supervised steps on the task before RL (~8 s on 2 cores; 0: the random model)
    seed: int = 0
    # a distillation teacher for the task (megappo/tasks/teacher.py: a larger Llama with the task's tokenizer,
    # ~16 s), warm-started with this target smoothing (the student's: 0.85); distillation.teacher_model.model_path
    # null takes it. None: no teacher
    teacher_smoothing: Optional[float] = None
    teacher_warm_start_steps: int = 300


@dataclass
class DataConfig:
    tokenizer: Optional[str] = None  # None: the actor model's tokenizer
    train_files: Union[str, list[str]] = "~/data/gsm8k/train.parquet"  # one Parquet path or a list
    val_files: Union[str, list[str], None] = "~/data/gsm8k/test.parquet"  # None: no validation
    prompt_key: str = "prompt"  # column holding the chat messages
    reward_fn_key: str = "data_source"  # column that picks the reward function
    max_prompt_length: int = 512  # prompt tokens after the chat template
    max_response_length: int = 512  # generated tokens per response
    train_batch_size: int = 1024  # prompts per PPO step
    # prompts generated at a time; resolved: train_batch_size. Larger (DAPO: 3x) with algorithm.filter_groups, so
    # that one generation batch usually leaves train_batch_size prompts after the filter
    gen_batch_size: Optional[int] = None
    val_batch_size: Optional[int] = None  # None: the whole validation set at once
    return_raw_chat: bool = False  # keep the untokenised messages (for an RM with another chat template)
    truncation: Literal["error", "left", "right"] = "error"  # what to do with a prompt over max_prompt_length
    filter_overlong_prompts: bool = False  # drop prompts over max_prompt_length when the dataset loads
    shuffle: bool = True  # shuffle training prompts each epoch
    seed: int = 1  # seed of that shuffle, so a resumed run sees the same order
    # Multimodal prompts (a vision-language actor; megappo.data.multimodal): the column of images, and the bounds
    # of Qwen's smart_resize in pixels (each image's area is brought into [min, max], sides multiples of 28). The
    # defaults are the released Qwen2-VL / Qwen2.5-VL processors' (56*56, 28*28*1280).
    image_key: str = "images"
    image_min_pixels: int = 3136
    image_max_pixels: int = 1003520
    synthetic: SyntheticTaskConfig = field(default_factory=SyntheticTaskConfig)


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


# ----------------------------------------------------------------------------------------------------------------
# root
# ----------------------------------------------------------------------------------------------------------------
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
