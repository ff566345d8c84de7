"""A megatron `TransformerConfig` (plus the GPTModel constructor arguments) from a Hugging Face `config.json`.

Supported families (HF `model_type`): those of `megappo.models.families` (llama, qwen2, qwen3, qwen2_moe, qwen3_moe,
mixtral); what tells them apart is read from that table. Both transformers-4
(`rope_theta`, `rope_scaling`) and transformers-5 (`rope_parameters`) rotary fields are read.

Mapping notes, per HF modeling code:
- MoE routing: HF computes softmax over all experts, takes the top-k and renormalises when `norm_topk_prob`
  (Qwen3-MoE, Mixtral always). Renormalised top-k of a softmax equals softmax over the top-k logits, which is
  megatron's `moe_router_pre_softmax=False`; without renormalisation (Qwen2-MoE) it is `pre_softmax=True`.
- Qwen2-MoE's shared expert output is scaled by `sigmoid(shared_expert_gate(x))`: `moe_shared_expert_gate=True`.
- MoE models use `add_bias_linear=False` (megatron-core 0.16 fails with expert biases; the HF families have none).
- The vocabulary is padded to a multiple of `make_vocab_size_divisible_by * lcm(tp, 8)`, not megatron's
  `make_vocab_size_divisible_by * tp`: the padded size is then the same at TP 1, 2, 4 and 8, so a checkpoint saved
  at one of them loads at any other (with megatron's rule Qwen's 151936 pads to 151936 at TP1 but 152064 at TP2,
  and the embedding no longer fits). Logits have `ModelSpecArgs.padded_vocab_size` columns; columns >= `vocab_size`
  are padding that log-prob code must mask.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional, Union

import torch
import torch.nn.functional as F

from megappo.models.families import FAMILIES, SUPPORTED_FAMILIES, Family
from megappo.platform.device import Platform
from megappo.platform.layout import ParallelLayout

# Megatron's llama-3 rope scaling (`RotaryEmbedding._apply_scaling`) fixes these; other values cannot be honoured.
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class UnsupportedModelError(ValueError):
    """A Hugging Face config megappo cannot map onto megatron-core; the message says what and what is supported."""


@dataclass(frozen=True)
class ModelSpecArgs:
    """Everything `GPTModel(...)` needs besides the TransformerConfig, and how the layer spec is chosen."""

    family: str  # HF model_type
    vocab_size: int  # the tokenizer's / HF embedding rows
    padded_vocab_size: int  # megatron embedding rows (see pad_vocab_size)
    max_sequence_length: int
    share_embeddings_and_output_weights: bool
    position_embedding_type: str = "rope"
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    rope_scaling: bool = False  # llama-3 style frequency scaling
    rope_scaling_factor: float = 8.0
    seq_len_interpolation_factor: Optional[float] = None  # "linear" rope scaling
    num_experts: Optional[int] = None
    moe_grouped_gemm: bool = False
    qk_layernorm: bool = False
    normalization: str = "RMSNorm"
    use_transformer_engine: bool = False  # TE layer spec (CUDA + TE importable) vs megatron's local spec
    hf_architecture: str = ""


def load_hf_config_dict(hf_config_or_dir: Union[str, os.PathLike, Mapping[str, Any], Any]) -> dict[str, Any]:
    """A plain dict of HF config fields from a model directory, a config.json path, a dict or a PretrainedConfig."""
    if isinstance(hf_config_or_dir, Mapping):
        return dict(hf_config_or_dir)
    if isinstance(hf_config_or_dir, (str, os.PathLike)):
        path = os.fspath(hf_config_or_dir)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no Hugging Face config at {path}; pass a model directory containing config.json")
        with open(path) as f:
            try:
                return json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not valid JSON ({e}); re-download or re-export the model") from e
    if hasattr(hf_config_or_dir, "to_dict"):
        return hf_config_or_dir.to_dict()
    raise TypeError(
        f"expected a model directory, config.json path, dict or PretrainedConfig; got {type(hf_config_or_dir)}"
    )


def transformer_engine_available() -> bool:
    """True when transformer-engine imports (chosen at run time; never imported unconditionally)."""
    try:
        import importlib

        importlib.import_module("transformer_engine")
    except Exception:  # noqa: BLE001 - a broken TE install (ABI mismatch) must fall back, not crash
        return False
    return True


def _rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """Rotary base and scaling from transformers-5 `rope_parameters` or transformers-4 `rope_theta`/`rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    if not params and scaling:
        params = scaling
    base = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    out: dict[str, Any] = dict(rotary_base=float(base))
    partial = cfg.get("partial_rotary_factor", params.get("partial_rotary_factor"))
    if partial is not None:
        out["rotary_percent"] = float(partial)
    if rope_type == "default":
        return out
    if rope_type == "llama3":
        for key, expected in _LLAMA3_FIXED.items():
            if key in params and float(params[key]) != expected:
                raise UnsupportedModelError(
                    f"llama3 rope scaling with {key}={params[key]} is not supported: megatron-core's RotaryEmbedding "
                    f"fixes {key}={expected}"
                )
        return {**out, "rope_scaling": True, "rope_scaling_factor": float(params.get("factor", 8.0))}
    if rope_type == "linear":
        return {**out, "seq_len_interpolation_factor": float(params["factor"])}
    raise UnsupportedModelError(
        f"rope type {rope_type!r} is not supported; supported: default, llama3, linear"
    )


@dataclass(frozen=True)
class HFArchitecture:
    """The architecture facts of a HF decoder, read once from config.json for both model building and conversion."""

    family: str  # HF model_type, one of SUPPORTED_FAMILIES
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # rows of the HF embedding (megatron's padding excluded)
    ffn_size: int  # dense MLP intermediate size
    num_experts: int  # 0: dense model
    moe_ffn_size: int
    shared_expert_size: int  # 0: no shared expert
    shared_expert_gate: bool  # qwen2_moe: sigmoid gate on the shared expert's output
    moe_layers: tuple[bool, ...]  # per layer: MoE block (True) or dense MLP
    qkv_bias: bool
    qk_norm: bool  # qwen3: RMSNorm on each query/key head
    tied_embeddings: bool
    moe_topk: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights (see the module docstring)


def read_hf_architecture(
    hf_config_or_dir: Union[str, os.PathLike, Mapping[str, Any], Any], source: Optional[str] = None
) -> HFArchitecture:
    """The one reader of a HF config's architecture (model directory, config.json path, dict or PretrainedConfig).

    Raises UnsupportedModelError naming `source` (default: the config path, or "config.json") and listing the
    supported families for a model megappo cannot map.
    """
    if source is None:
        source = "config.json"
        if isinstance(hf_config_or_dir, (str, os.PathLike)):
            path = os.fspath(hf_config_or_dir)
            source = os.path.join(path, "config.json") if os.path.isdir(path) else path
    cfg = load_hf_config_dict(hf_config_or_dir)
    if not isinstance(cfg, Mapping):
        raise UnsupportedModelError(f"{source}: holds a JSON {type(cfg).__name__}, not an object; restore the "
                                    f"model's config.json")
    try:
        return _architecture(cfg, source)
    except UnsupportedModelError:
        raise
    except KeyError as e:
        raise UnsupportedModelError(f"{source}: has no {e.args[0]!r}, which a {cfg.get('model_type')!r} config "
                                    f"needs; restore the model's config.json") from None
    except (TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
        raise UnsupportedModelError(f"{source}: a field has an unusable value ({type(e).__name__}: {e}); restore "
                                    f"the model's config.json") from None


def _architecture(cfg: Mapping[str, Any], source: str) -> HFArchitecture:
    family = cfg.get("model_type", "")
    fam = FAMILIES.get(family) if isinstance(family, str) else None
    if fam is None:
        archs = cfg.get("architectures") or ["?"]
        raise UnsupportedModelError(
            f"{source}: unsupported model_type {family!r} (architectures {archs}); supported families: "
            f"{', '.join(SUPPORTED_FAMILIES)}"
        )
    if fam.refuses_attention_bias and cfg.get("attention_bias"):
        raise UnsupportedModelError(
            f"{source}: {family} with attention_bias=true is not supported (megatron's add_qkv_bias has no o_proj "
            "bias); supported: the released checkpoints' attention_bias=false"
        )
    if cfg.get("mlp_bias"):
        raise UnsupportedModelError(f"{source}: mlp_bias=true is not supported (megappo builds bias-free MLPs)")
    n_layers = int(cfg["num_hidden_layers"])
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    num_experts, moe_ffn, shared, moe_layers = _moe_shape(fam, family, cfg, n_layers, source)
    qkv_bias = bool(cfg.get(fam.qkv_bias_field, fam.qkv_bias)) if fam.qkv_bias_field else fam.qkv_bias
    return HFArchitecture(
        family=family,
        num_layers=n_layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        vocab_size=int(cfg["vocab_size"]),
        ffn_size=int(cfg["intermediate_size"]),
        num_experts=num_experts,
        moe_ffn_size=moe_ffn,
        shared_expert_size=shared,
        shared_expert_gate=shared > 0,
        moe_layers=moe_layers,
        qkv_bias=qkv_bias,
        qk_norm=fam.qk_norm,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        moe_topk=int(cfg.get("num_experts_per_tok") or 0),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", fam.norm_topk_prob)),
    )


def _moe_shape(fam: Family, family: str, cfg: Mapping[str, Any], n_layers: int, source: str
               ) -> tuple[int, int, int, tuple[bool, ...]]:
    """(experts, expert width, shared expert width, MoE or dense per layer) of a family; zeros for a dense one."""
    if fam.moe is None:
        return 0, 0, 0, tuple(False for _ in range(n_layers))
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts (num_experts is an alias): accept both
    num_experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    if not num_experts:
        raise UnsupportedModelError(f"{source}: {family} without num_experts/num_local_experts")
    if fam.moe_layers == "every":
        moe_ffn = int(cfg["intermediate_size"])
        moe_layers = tuple(True for _ in range(n_layers))
    else:  # layers listed in mlp_only_layers, and those off the sparse step, are dense
        moe_ffn = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        dense = set(cfg.get("mlp_only_layers") or [])
        moe_layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(n_layers))
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if fam.shared_expert else 0
    return num_experts, moe_ffn, shared, moe_layers


def _moe_fields(arch: HFArchitecture, layout: ParallelLayout, platform: Platform, use_te: bool) -> dict[str, Any]:
    pattern = [int(m) for m in arch.moe_layers]
    fields_: dict[str, Any] = dict(
        num_moe_experts=arch.num_experts,
        moe_ffn_hidden_size=arch.moe_ffn_size,
        moe_router_topk=arch.moe_topk,
        moe_router_pre_softmax=not arch.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="none",  # RL fine-tuning: no aux loss unless overridden
        moe_aux_loss_coeff=0.0,
        moe_layer_freq=1 if all(pattern) else pattern,
        # alltoall on GPU. On CPU allgather is simpler, but megatron allows only alltoall with variable sequence
        # lengths, which pipeline parallelism turns on (see variable_seq_lengths below).
        moe_token_dispatcher_type="alltoall" if platform.is_cuda or layout.pp > 1 else "allgather",
        # Grouped GEMM needs TE's GroupedLinear (or the grouped_gemm package): only on CUDA with TE.
        moe_grouped_gemm=bool(platform.is_cuda and use_te),
        moe_router_dtype="fp32",
    )
    if arch.shared_expert_size:
        fields_.update(moe_shared_expert_intermediate_size=arch.shared_expert_size,
                       moe_shared_expert_gate=arch.shared_expert_gate)
    return fields_


def _check_runtime_supported(family: str, cfg: dict[str, Any]) -> None:
    """What megatron cannot run beyond the architecture read by read_hf_architecture."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act={cfg['hidden_act']!r} is not supported; these families use 'silu'")
    if cfg.get("use_sliding_window") or (FAMILIES[family].sliding_window_on and cfg.get("sliding_window")):
        raise UnsupportedModelError(
            f"sliding-window attention (sliding_window={cfg.get('sliding_window')}) is not supported; use a "
            "checkpoint with full attention"
        )


# Every TP size dividing this pads the vocabulary identically, which keeps checkpoints layout-independent.
LAYOUT_INDEPENDENT_TP = 8


def pad_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """The smallest multiple of `divisible_by * lcm(tp, 8)` that holds `vocab_size` (same for tp in 1, 2, 4, 8)."""
    multiple = divisible_by * math.lcm(tp, LAYOUT_INDEPENDENT_TP)
    return int(math.ceil(vocab_size / multiple) * multiple)


def _layout_fields(layout: ParallelLayout, platform: Platform) -> dict[str, Any]:
    """The TransformerConfig fields of the parallel layout and the platform's dtype and placement."""
    dtype = platform.dtype
    return dict(
        # parallel layout
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp and layout.vpp > 1 else None,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp or layout.tp,
        sequence_parallel=layout.sequence_parallel,
        # micro-batches of different lengths go through the pipeline (dynamic batch size): exchange shapes
        variable_seq_lengths=layout.pp > 1,
        # megatron rejects variable_seq_lengths with the (default) allgather dispatcher even for dense models
        moe_token_dispatcher_type="alltoall" if layout.pp > 1 else "allgather",
        # dtypes and placement
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not platform.is_cuda,
    )


def transformer_config_from_hf(
    hf_config_or_dir: Union[str, os.PathLike, Mapping[str, Any], Any],
    layout: ParallelLayout,
    platform: Platform,
    *,
    make_vocab_size_divisible_by: int = 128,
    use_transformer_engine: Optional[bool] = None,
    **overrides: Any,
):
    """Build `(TransformerConfig, ModelSpecArgs)` for a Hugging Face causal-LM config.

    `overrides` replace any TransformerConfig field (e.g. `recompute_granularity="full"`,
    `moe_aux_loss_coeff=0.01`). `use_transformer_engine=None` picks TE when CUDA is used and TE imports.
    Raises UnsupportedModelError (listing the supported families) for anything else.
    """
    from megatron.core.transformer import TransformerConfig

    arch = read_hf_architecture(hf_config_or_dir)
    cfg = load_hf_config_dict(hf_config_or_dir)
    family = arch.family
    _check_runtime_supported(family, cfg)
    if use_transformer_engine is None:
        use_transformer_engine = platform.is_cuda and transformer_engine_available()
    use_te = bool(use_transformer_engine)

    rope = _rope(cfg)
    tc_fields: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.get("rms_norm_eps", 1e-6),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=float(cfg.get("attention_dropout", 0.0) or 0.0),
        init_method_std=cfg.get("initializer_range", 0.02),
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        **_layout_fields(layout, platform),
    )
    if arch.num_experts:
        tc_fields.update(_moe_fields(arch, layout, platform, use_te))
    unknown = set(overrides) - {f.name for f in fields(TransformerConfig)}
    if unknown:
        raise TypeError(f"unknown TransformerConfig fields in overrides: {sorted(unknown)}")
    tc_fields.update(overrides)
    config = TransformerConfig(**tc_fields)

    vocab = arch.vocab_size
    spec = ModelSpecArgs(
        family=family,
        vocab_size=vocab,
        padded_vocab_size=pad_vocab_size(vocab, layout.tp, make_vocab_size_divisible_by),
        max_sequence_length=cfg.get("max_position_embeddings", 4096),
        share_embeddings_and_output_weights=arch.tied_embeddings,
        num_experts=tc_fields.get("num_moe_experts"),
        moe_grouped_gemm=bool(tc_fields.get("moe_grouped_gemm", False)),
        qk_layernorm=arch.qk_norm,
        use_transformer_engine=use_te,
        hf_architecture=(cfg.get("architectures") or [""])[0],
        **rope,
    )
    return config, spec
