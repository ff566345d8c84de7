"""Vision-language models (Qwen2.5-VL, Qwen2-VL) on megatron-core; see megappo.models.vlm.model."""
