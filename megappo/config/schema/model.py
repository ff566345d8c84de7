"""The model, its LoRA adapters, the optimiser and the megatron parallel layout: shared by actor, reference and
critic (`actor_rollout_ref.model`, `*.optim`, `*.megatron`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from megappo.config.fields import DType


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
