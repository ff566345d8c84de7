"""Which Hugging Face model directories hold a vision-language model, read from their config.json alone: the
trainer's preflight and the SGLang server launcher ask before torch is imported (`megappo.models.vlm.config` reads
the whole config, with megatron's vision tower behind it)."""
from __future__ import annotations

import json
import os
from typing import Optional

VLM_MODEL_TYPES = ("qwen2_5_vl", "qwen2_vl")


def model_type(path: Optional[str]) -> Optional[str]:
    """`model_type` of `<path>/config.json` (None: no path, no readable config, or no model_type in it)."""
    if not path:
        return None
    try:
        with open(os.path.join(os.path.expanduser(path), "config.json"), encoding="utf-8") as f:
            return json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def is_vlm_dir(path: Optional[str]) -> bool:
    """Whether `path` holds a Qwen2-VL / Qwen2.5-VL model (VLM_MODEL_TYPES)."""
    return model_type(path) in VLM_MODEL_TYPES
