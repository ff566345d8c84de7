"""Tiny random-weight Qwen2.5-VL / Qwen2-VL models and image batches for tests.

Sizes divide every layout the tests use: LM 4 layers, 4 heads / 2 KV heads (TP2 x PP2); vision 4 blocks, 2 heads,
window attention in blocks 0 and 2, full attention in 1 and 3.
"""
from __future__ import annotations

import os
from typing import Any

import torch

IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 500, 501, 502, 503

_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.05,
             rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[2, 3, 3]))


# model_type -> (transformers config class, model class, the vision tower's config at test size)
_VLMS = {
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration",
                   dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                        spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1, 3],
                        initializer_range=0.05)),
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration",
                 dict(depth=4, embed_dim=32, mlp_ratio=2, num_heads=2, hidden_size=64, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, initializer_range=0.05)),
}


def tiny_vlm_config(family: str = "qwen2_5_vl", **overrides: Any):
    import transformers

    if family not in _VLMS:
        raise ValueError(f"unknown VLM family {family!r}")
    ids = dict(image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
               vision_end_token_id=VISION_END, tie_word_embeddings=False)
    config_cls, _, vision = _VLMS[family]
    return getattr(transformers, config_cls)(text_config=dict(_TEXT), vision_config=dict(vision), **ids, **overrides)


def make_hf_vlm(out_dir: str, family: str = "qwen2_5_vl", seed: int = 0, **overrides: Any) -> str:
    """Write a random-weight Qwen2(.5)-VL model directory (config + safetensors) and return its path."""
    import transformers

    cfg = tiny_vlm_config(family, **overrides)
    cls = getattr(transformers, _VLMS[family][1])
    torch.manual_seed(seed)
    model = cls(cfg).float()
    with torch.no_grad():  # HF initialises norms to one: randomise them so that a swapped norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.add_(torch.randn_like(p) * 0.1)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def image_batch(hf_dir_or_config: Any, sizes=((56, 84), (112, 56), (140, 112)), seed: int = 0
                ) -> dict[str, torch.Tensor]:
    """Images of the given (height, width) through the real image processor; see megappo.kinds.qwen2_vl.verify."""
    from megappo.kinds.qwen2_vl.verify import image_batch as make

    return make(hf_dir_or_config, sizes, seed)
