"""Reading Qwen2.5-VL / Qwen2-VL configs as released (transformers-4 layout: LM fields at the top level,
`rope_scaling: {type: mrope}`) and as transformers 5 writes them (`text_config`, `rope_parameters`)."""
from __future__ import annotations

import pytest

from megappo.models.hf_config import UnsupportedModelError
from megappo.kinds import kind_of
from megappo.kinds.qwen2_vl.config import read_vlm_config

# Qwen2.5-VL-3B-Instruct's config.json (the fields megappo reads)
QWEN25_VL_3B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "hidden_size": 2048,
    "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 2,
    "vocab_size": 151936, "max_position_embeddings": 128000, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu",
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2},
}
QWEN2_VL_2B_VISION = {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
                      "hidden_size": 1536, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}


def test_released_qwen2_5_vl_config():
    args = read_vlm_config(QWEN25_VL_3B)
    v = args.vision
    assert (v.depth, v.hidden_size, v.num_heads, v.head_dim, v.intermediate_size) == (32, 1280, 16, 80, 3420)
    assert (v.out_hidden_size, v.window_size, v.fullatt_block_indexes, v.gated_mlp) == (2048, 112, (7, 15, 23, 31),
                                                                                        True)
    t = args.text_config
    assert t["model_type"] == "qwen2" and t["mrope_section"] == [16, 24, 24] and t["tie_word_embeddings"]
    assert t["rope_parameters"] == {"rope_type": "default", "rope_theta": 1000000.0}
    assert args.image_token_id == 151655 and kind_of(QWEN25_VL_3B).multi_modal


def test_released_qwen2_vl_config_and_refusals():
    cfg = {**QWEN25_VL_3B, "model_type": "qwen2_vl", "vision_config": QWEN2_VL_2B_VISION}
    v = read_vlm_config(cfg).vision
    assert (v.hidden_size, v.intermediate_size, v.out_hidden_size, v.norm, v.gated_mlp, v.window_size) == (
        1280, 5120, 1536, "LayerNorm", False, 0)
    with pytest.raises(UnsupportedModelError, match="mrope_section"):
        read_vlm_config({**QWEN25_VL_3B, "rope_scaling": {"type": "default"}})
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        read_vlm_config({**QWEN25_VL_3B, "vision_config": {**QWEN25_VL_3B["vision_config"], "hidden_act": "gelu"}})
    assert not kind_of({"model_type": "qwen2"}).multi_modal
