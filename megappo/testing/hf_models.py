"""Tiny random-weight Hugging Face models of every family megappo supports, written as real HF directories.

Sizes are chosen so that every parallel layout the tests use divides them: 4 layers (PP=2 x VPP=2), 4 query heads
and 2 KV heads (TP=2), 4 experts (EP=2).
"""
from __future__ import annotations

import os
from typing import Any

import torch

# family -> (config class name, causal-LM class name, sequence-classification class name or None)
FAMILIES: dict[str, tuple[str, str, str | None]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", "LlamaForSequenceClassification"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "Qwen2ForSequenceClassification"),
    "qwen2_tied": ("Qwen2Config", "Qwen2ForCausalLM", "Qwen2ForSequenceClassification"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "Qwen3ForSequenceClassification"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", None),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", None),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", None),
}

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    initializer_range=0.05,  # larger than HF's 0.02 so logits differ visibly between tokens
    attention_dropout=0.0,
)

_FAMILY_KW: dict[str, dict[str, Any]] = {
    "llama": dict(rope_theta=500000.0, tie_word_embeddings=False),
    "qwen2": dict(rope_theta=1000000.0, tie_word_embeddings=False),
    "qwen2_tied": dict(rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen3": dict(rope_theta=1000000.0, head_dim=16, tie_word_embeddings=False),
    "qwen2_moe": dict(
        rope_theta=1000000.0, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False,
        tie_word_embeddings=False,
    ),
    "qwen3_moe": dict(
        rope_theta=1000000.0, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, tie_word_embeddings=False,
    ),
    "mixtral": dict(rope_theta=1000000.0, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
}


def tiny_hf_config(family: str, vocab_size: int = 512, **overrides: Any):
    """A `transformers` config object of `family` at test size; `overrides` replace any field."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {sorted(FAMILIES)}")
    cls = getattr(transformers, FAMILIES[family][0])
    kw = {**_COMMON, **_FAMILY_KW[family], "vocab_size": vocab_size, **overrides}
    return cls(**kw)


def make_hf_model(
    family: str,
    out_dir: str,
    *,
    seq_cls: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    tokenizer: bool = True,
    **overrides: Any,
) -> str:
    """Write a random-weight HF model directory (config, safetensors, tokenizer) and return its path.

    `seq_cls=True` writes a `*ForSequenceClassification` model with one label (a reward model's `score` head).
    """
    import transformers

    from megappo.testing.tokenizer import make_tokenizer

    cfg_name, lm_name, cls_name = FAMILIES[family]
    tok = make_tokenizer(vocab_size=overrides.pop("tokenizer_vocab_size", 512)) if tokenizer else None
    vocab = overrides.pop("vocab_size", len(tok) if tok is not None else 512)
    cfg = tiny_hf_config(family, vocab_size=vocab, **overrides)
    if tok is not None:
        cfg.eos_token_id = tok.eos_token_id
        cfg.pad_token_id = tok.pad_token_id
        cfg.bos_token_id = None
    if seq_cls:
        if cls_name is None:
            raise ValueError(f"family {family!r} has no sequence-classification model in transformers")
        cfg.num_labels = 1
        model_cls = getattr(transformers, cls_name)
    else:
        model_cls = getattr(transformers, lm_name)
    torch.manual_seed(seed)
    model = model_cls(cfg).to(dtype)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    if tok is not None:
        tok.save_pretrained(out_dir)
    return out_dir
