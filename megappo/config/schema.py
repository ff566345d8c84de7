"""The configuration tree: every option megappo reads, with its single default.

Names, nesting and meanings follow verl's `ppo_megatron_trainer.yaml`, so a verl command line carries over
(`actor_rollout_ref.actor.use_kl_loss=true algorithm.kl_ctrl.type=adaptive`). Recipes under `recipes/` and
command-line overrides only change values here; they never add keys.

A field left `None` with a "resolved" comment is filled from another field by `megappo.config.loader.resolve`,
the one place derived defaults live. Everything else is plain data: no imports of torch or megatron.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

# Estimators of KL(actor || ref), per token; "+" variants use the value forward and k2's gradient backward.
KLKind = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "abs+", "mse+", "k2+",
                 "low_var_kl+", "k3+"]
LossAggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                      "seq-mean-token-sum-norm"]
DType = Literal["bfloat16", "float16", "float32"]


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
    # one of verl's named presets (README; megappo/config/rollout_presets.py), e.g. decoupled_geo_rs_seq_tis: the
    # section starts from its fields, and the keys above set in the same recipe or command line override them
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
    # a name of megappo.algos.estimators (README's table): gae (needs a critic), grpo, rloo, reinforce_plus_plus,
    # reinforce_plus_plus_baseline, remax, opo, gpg, grpo_passk, grpo_vectorized, rloo_vectorized, gdpo (with
    # gdpo_reward_keys), optimal_token_baseline, tir_optimal_token_baseline (not with rollout_correction's
    # bypass_mode); or custom_adv_estimator.name
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
    """LoRA adapters over a frozen base (verl's megatron `model.lora`; megappo/models/lora.py). The reference policy
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
class ValKwargsConfig:
    """Sampling used for validation generations: greedy by default, so validation scores are repeatable."""

    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = False


@dataclass
class MultiTurnConfig:
    """Multi-turn tool-calling rollouts (verl 0.9.1's `rollout.multi_turn`; megappo/multi_turn/loop.py): the model
    writes a tool call (`format`), the trainer runs the tool and appends its answer as the chat template renders it,
    and the model goes on, until it answers without a call, response_length tokens are spent over all turns, or a
    turn limit is reached. Only the model's tokens are trained on (the tool answers' tokens are masked)."""

    enable: bool = False
    max_assistant_turns: Optional[int] = None  # None: no limit but response_length
    max_user_turns: Optional[int] = None  # tool rounds; None: no limit but response_length
    tool_config_path: Optional[str] = None  # YAML of verl's shape (megappo/multi_turn/tools.py)
    max_parallel_calls: int = 1  # tool calls of one assistant turn that are run (later ones are dropped)
    max_tool_response_length: int = 256  # characters of a tool answer the model reads
    tool_response_truncate_side: Literal["left", "middle", "right"] = "middle"
    format: Literal["hermes"] = "hermes"  # <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Qwen2.5/3)
    # strict: check each trajectory's tokens against the chat template applied to its final messages
    # (multi_turn/template_mismatch_fraction); disable: skip the check
    tokenization_sanity_check_mode: Literal["strict", "disable"] = "strict"
    # the pool the tool calls run in (megappo/multi_turn/pool.py): thread, or ray (actors holding copies of the
    # tools; one past a deadline is replaced); calls at once; a call's deadline (None: the tool's own timeout_s
    # plus 5 s, or 60 s)
    tool_backend: Literal["thread", "ray"] = "thread"
    tool_workers: int = 32
    tool_timeout_s: Optional[float] = None
    # stop the run when the tool itself fails (raises, is not configured, its sandbox fails: tool/failure_fraction)
    # on more than this fraction of the calls for max_tool_failure_steps steps in a row: a broken tool or tool
    # config. The policy's own mistakes (failing code, bad arguments) never count: a model still learning makes
    # them (null: never stop)
    max_tool_failure_fraction: Optional[float] = 0.5
    max_tool_failure_steps: int = 3


@dataclass
class RolloutConfig:
    # The engine (megappo/rollout/registry.py): hf, megappo's in-process engine (works on CPU); sglang, SGLang
    # servers the trainer starts (or server_urls), shared by every data-parallel replica.
    name: str = "hf"
    n: int = 1  # responses sampled per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): no top-k filtering
    do_sample: bool = True  # false: greedy decoding
    ignore_eos: bool = False  # keep generating past EOS up to response_length (throughput benchmarks)
    prompt_length: Optional[int] = None  # resolved: data.max_prompt_length
    response_length: Optional[int] = None  # resolved: data.max_response_length
    dtype: Optional[DType] = None  # resolved: actor_rollout_ref.model.dtype
    gpu_memory_utilization: float = 0.5  # fraction of GPU memory the engine may take (weights + KV cache)
    tensor_model_parallel_size: int = 1  # inference tensor parallel size of one engine replica
    max_num_batched_tokens: int = 8192  # engine's per-step token budget
    max_num_seqs: int = 1024  # engine's concurrent sequence limit
    max_model_len: Optional[int] = None  # None: prompt_length + response_length
    # release the KV cache while training, re-allocate before generating; the in-process hybrid engine (hf) of a
    # full-parameter actor also frees its weights from each step's rollout to its weight sync (sync mode)
    free_cache_engine: bool = True
    log_prob_micro_batch_size_per_gpu: Optional[int] = None  # old-log-prob recompute micro batch
    log_prob_use_dynamic_bsz: Optional[bool] = None  # resolved: actor.use_dynamic_bsz
    log_prob_max_token_len_per_gpu: Optional[int] = None  # resolved: actor.ppo_max_token_len_per_gpu
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the engine as-is (e.g. SGLang args)
    # sglang: URLs of running servers (http://host:port); empty: the trainer starts servers_per_node per node
    server_urls: list[str] = field(default_factory=list)
    # sglang, started servers: how many each node's first rank starts (server i on GPUs i*tp .. i*tp+tp-1);
    # None: one per tensor_model_parallel_size GPUs of the node, one on a CPU node
    servers_per_node: Optional[int] = None
    # sglang: every health_check_interval_s the client has each server generate one token (`is_healthy`, timeout
    # health_check_timeout_s); a server that fails it, or a request, is restarted or dropped. The first wait is
    # server_start_timeout_s.
    health_check_interval_s: float = 30.0
    health_check_timeout_s: float = 5.0
    # sglang, started servers: a dead one is restarted before the next weight sync, which gives it the current
    # weights before it serves again; false: it is dropped (the others take its share)
    restart_failed_servers: bool = True
    # sglang: none: megappo spreads requests over the servers itself; sglang: through a real sglang-router that
    # the trainer starts in front of them (installed beside SGLang; router_python, default server_python)
    router: Literal["none", "sglang"] = "none"
    router_policy: Literal["round_robin", "cache_aware", "power_of_two", "random"] = "round_robin"
    router_python: Optional[str] = None
    server_python: Optional[str] = None  # sglang: the python that has SGLang installed; None: this one
    # sglang: the address a started server binds and is reached at; multi-node: this node's cluster address
    server_host: str = "127.0.0.1"
    api_key: Optional[str] = None  # sglang: the servers' API key; None: a random one per started server
    # sglang: a file whose first line is that key, read at start (keeps it off command lines and out of
    # --print-config); for servers started elsewhere (megappo rollout-server --api-key-file)
    api_key_file: Optional[str] = None
    server_start_timeout_s: float = 600.0  # sglang: longest wait for a started server (cold start, model load)
    request_timeout_s: float = 600.0  # sglang: HTTP timeout of one generation request
    sync_timeout_s: float = 60.0  # sglang: timeout of a weight-control call and of the weight group's collectives
    # sglang, distributed sync: the address the trainer's rendezvous store listens on (only there); None:
    # server_host (127.0.0.1 for local servers). Multi-node: an address of this node that the servers reach.
    weight_sync_master_address: Optional[str] = None
    # How the actor's weights reach the engine after each update. auto: in-process for hf, distributed for sglang.
    # distributed: one broadcast per bucket over a group of the trainer and every server's ranks (NCCL on GPU, gloo
    # on CPU); tensor: colocated servers take the tensors by handle (CUDA IPC; shared memory on CPU); disk: a
    # Hugging Face directory in weight_sync_dir that the servers reload (the directory must be visible to them).
    weight_sync: Literal["auto", "distributed", "tensor", "disk"] = "auto"
    # Tensors exported and sent at a time. The trainer keeps send buffers across syncs: distributed one bucket
    # (flattened, one broadcast each); tensor on CPU two buckets of shared memory (/dev/shm; in Docker use
    # --ipc=host or --shm-size).
    weight_sync_bucket_mb: int = 512
    weight_sync_dir: Optional[str] = None  # disk: where the export goes; None: <trainer.default_local_dir>/weight_sync
    # A LoRA actor's sync (megappo's key). merged: the adapted layers' merged weights (W + alpha/r * B A) through
    # weight_sync. adapter (sglang on GPU): a PEFT adapter directory in weight_sync_dir (visible to the servers) that
    # each server loads (/load_lora_adapter, the previous one unloaded) and every request names: rank-r tensors
    # instead of whole layers, the base stays as loaded. SGLang 0.5's CPU backend cannot serve LoRA (refused).
    lora_sync: Literal["merged", "adapter"] = "merged"
    # After every sync, compare each server's log-probs of fixed tokens with the trainer's and stop the run on a
    # mismatch larger than verify_sync_atol (None: 1e-3 in float32, 5e-2 in 16-bit dtypes). Costs one forward.
    verify_sync: bool = False
    verify_sync_atol: Optional[float] = None
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)


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


@dataclass
class CustomRewardFunctionConfig:
    path: Optional[str] = None  # Python file defining the function; None: the built-in registry by data_source
    name: str = "compute_score"  # fn(data_source, solution_str, ground_truth, extra_info) -> float | dict


# ----------------------------------------------------------------------------------------------------------------
# trainer
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class GuardConfig:
    """The tuning guide's rules for a run whose policy moves too far in one step, automated (megappo/trainer/guard.py).

    A step whose `kl_metric` passes `kl_threshold`, or whose actor loss or gradient norm is NaN/Inf, is undone: the
    last good checkpoint is restored (so rollback needs trainer.save_freq > 0; the guard then also saves step 0), the
    actor's learning rate is multiplied by lr_factor, the KL coefficient by kl_coef_factor and the clip ratio by
    clip_ratio_factor, and the step is tried again. After max_retries rollbacks without getting past the step, the
    run stops with its last good checkpoint. Without checkpoints a tripped step stops the run."""

    enable: bool = True
    kl_threshold: float = 0.2  # a step whose kl_metric passes this is rolled back
    kl_metric: str = "actor/ppo_kl"  # the step's metric compared with kl_threshold (e.g. kl/mean: KL to the reference)
    epoch_kl_stop: Optional[float] = None  # skip a step's remaining PPO epochs once an epoch's actor/ppo_kl passes it
    max_retries: int = 3  # rollbacks in a row (without passing the tripped step) before the run stops
    lr_factor: float = 0.5  # actor learning rate multiplier per rollback
    kl_coef_factor: float = 5.0  # kl_coef (in reward) / kl_loss_coef (as loss) multiplier per rollback: 0.001 -> 0.005
    clip_ratio_factor: float = 0.5  # clip_ratio (low and high) multiplier per rollback: 0.2 -> 0.1


@dataclass
class TrainerConfig:
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when available, else cpu
    nnodes: int = 1
    n_gpus_per_node: int = 8  # processes per node (CPU: ranks per node)
    total_epochs: int = 30  # passes over the training prompts
    total_training_steps: Optional[int] = None  # None: total_epochs * steps per epoch; set: caps the run
    critic_warmup: int = 0  # steps that update only the critic
    val_before_train: bool = True  # run validation once before the first step
    test_freq: int = -1  # validate every N steps (and after the last); -1: no periodic validation
    log_val_generations: int = 0  # validation samples printed/logged per validation
    save_freq: int = -1  # checkpoint every N steps (and after the last); -1: never
    max_ckpt_to_keep: Optional[int] = None  # oldest checkpoints deleted beyond this; None: keep all
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"  # auto: newest checkpoint in default_local_dir
    resume_from_path: Optional[str] = None  # checkpoint to load when resume_mode is resume_path
    default_local_dir: Optional[str] = None  # resolved: checkpoints/{project_name}/{experiment_name}
    # A run owns default_local_dir (a lock on <dir>/.megappo.lock): a second run on it exits 1 naming the holder, or
    # first waits up to this many seconds for it to go. 0 (interactive): fail at once; launch/slurm/*.sbatch set 300,
    # so a requeued job waits out its previous incarnation's last seconds.
    dir_lock_wait_s: float = 0.0
    project_name: str = "megappo_examples"
    experiment_name: str = "gsm8k"
    # metrics.jsonl in default_local_dir is always written; these are the other sinks
    logger: list[Literal["console", "tensorboard", "wandb"]] = field(default_factory=lambda: ["console", "tensorboard"])
    balance_batch: bool = True  # reorder samples so data-parallel ranks get similar token counts
    guard: GuardConfig = field(default_factory=GuardConfig)
    # Save and stop (exit status 75, "requeue me") before this wall-clock time: ISO 8601 ("2026-12-04T06:00",
    # local time unless it has an offset), seconds since the epoch, or "slurm" for the job's end time
    # (SLURM_JOB_END_TIME). SIGTERM/SIGUSR1 do the same at once.
    save_before_deadline: Optional[str] = None


@dataclass
class AsyncTrainingConfig:
    """Rollouts that overlap training (megappo/trainer/rollout_source.py; verl's `async_training` names).

    sync: each step generates its batch, then trains. one_step_off: the batch of step k+1 is generated, with the
    weights step k started from, while step k trains; its samples are one update behind the policy that trains on
    them (off-policy by one step: see algorithm.rollout_correction). fully_async: a producer keeps generating the
    next steps' batches within a staleness budget (megappo/trainer/async_rollout.py), and the weights are synced
    every trigger_parameter_sync_step steps. Overlap needs the engine beside the trainer:
    actor_rollout_ref.hybrid_engine=false (the in-process engine then runs in its own process with
    rollout.engine_kwargs.threads CPU threads; SGLang servers are always separate processes)."""

    mode: Literal["sync", "one_step_off", "fully_async"] = "sync"
    # fully_async: a step trains require_batches mini-batches (data.train_batch_size must be require_batches *
    # actor.ppo_mini_batch_size prompts)
    require_batches: int = 1
    trigger_parameter_sync_step: int = 1  # fully_async: steps (local updates) between weight syncs, W
    # fully_async: the fraction of a sync window's samples (W steps' worth) that may be generated ahead with the
    # window before's weights: 0 none (no sample older than its window), 1 with W = 1 is one_step_off. A trained
    # batch is then at most floor((W - 1 + floor(staleness_threshold * W)) / W) weight versions old; staler ones
    # (generated under a looser threshold before a resume) are dropped and generated again.
    staleness_threshold: float = 0.1
    # fully_async: a weight sync aborts the generation in progress and continues its samples from their tokens
    # with the new weights (instead of waiting for it); needs an engine that can abort (hf)
    partial_rollout: bool = False


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
