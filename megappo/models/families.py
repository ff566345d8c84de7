"""The text families megappo builds with megatron-core's GPTModel, one table entry each: what tells one family's
config, tensor names and exported architecture from another's. The HF config reader (`models.hf_config`), the name
mapping of the conversion (`convert.mapping`) and the HF export (`convert.mcore_to_hf`) read it; none of them asks
which family it has.

Adding a text family is one `FAMILIES` entry (and its tiny model in `megappo.testing.hf_models` for the tests).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional


@dataclass(frozen=True)
class MoeNames:
    """How a family's checkpoint names an MoE block: `model.layers.{i}.{block}.gate.weight` is the router and
    `model.layers.{i}.{block}.experts.{e}.{gate|up|down}.weight` the experts' projections."""

    block: str = "mlp"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


@dataclass(frozen=True)
class Family:
    """One text family (its config.json `model_type`)."""

    causal_lm: str  # the transformers class of its causal LM (config.json `architectures`)
    seq_cls: str  # ... and of its sequence-classification model: what a value model (critic/reward) exports as
    qkv_bias: bool = False  # q/k/v projections carry biases
    qkv_bias_field: Optional[str] = None  # a config.json field that may turn qkv_bias off (default: qkv_bias)
    refuses_attention_bias: bool = False  # attention_bias=true is refused (megatron's qkv bias has no o_proj bias)
    qk_norm: bool = False  # RMSNorm on each query/key head
    moe: Optional[MoeNames] = None  # None: a dense model
    # which layers are MoE: "every" one, or "sparse_step": those on `decoder_sparse_step` not in `mlp_only_layers`
    # (their expert width `moe_intermediate_size`; "every" family's experts are `intermediate_size` wide)
    moe_layers: Literal["every", "sparse_step"] = "sparse_step"
    shared_expert: bool = False  # a sigmoid-gated shared expert (`shared_expert_intermediate_size`)
    norm_topk_prob: bool = False  # renormalise the top-k routing weights when config.json does not say
    sliding_window_on: bool = False  # a `sliding_window` value alone turns sliding-window attention on


FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM", "LlamaForSequenceClassification", refuses_attention_bias=True),
    # Qwen2 always has q/k/v biases, Qwen2-MoE unless qkv_bias=false
    "qwen2": Family("Qwen2ForCausalLM", "Qwen2ForSequenceClassification", qkv_bias=True),
    "qwen3": Family("Qwen3ForCausalLM", "Qwen3ForSequenceClassification", refuses_attention_bias=True, qk_norm=True),
    "qwen2_moe": Family("Qwen2MoeForCausalLM", "Qwen2MoeForSequenceClassification", qkv_bias=True,
                        qkv_bias_field="qkv_bias", moe=MoeNames(), shared_expert=True),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", "Qwen3MoeForSequenceClassification", refuses_attention_bias=True,
                        qk_norm=True, moe=MoeNames(), norm_topk_prob=True),
    "mixtral": Family("MixtralForCausalLM", "MixtralForSequenceClassification",
                      moe=MoeNames(block="block_sparse_moe", gate="w1", up="w3", down="w2"), moe_layers="every",
                      norm_topk_prob=True, sliding_window_on=True),
}
SUPPORTED_FAMILIES = tuple(FAMILIES)
