"""Reading a Qwen2.5-VL / Qwen2-VL Hugging Face config (no megatron import)."""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional, Union

from megappo.kinds import QWEN2_VL
from megappo.kinds.qwen2_vl.vision import VisionArgs, vision_args_from_hf
from megappo.models.hf_config import UnsupportedModelError, load_hf_config_dict


@dataclasses.dataclass(frozen=True)
class VLMArgs:
    family: str
    vision: VisionArgs
    image_token_id: int
    video_token_id: Optional[int]
    text_config: dict  # a plain qwen2 causal-LM config dict: what the text-only builder and converter read


def read_vlm_config(hf_dir_or_config: Union[str, os.PathLike, Mapping[str, Any], Any]) -> VLMArgs:
    """Split a Qwen2(.5)-VL config into its vision args and a qwen2 text config (transformers 4 and 5 layouts)."""
    cfg = load_hf_config_dict(hf_dir_or_config)
    family = cfg.get("model_type")
    if family not in QWEN2_VL.model_types:
        raise UnsupportedModelError(f"model_type {family!r} is not a vision-language model ({QWEN2_VL.model_types})")
    # transformers 5 nests the LM under text_config; transformers 4 wrote its fields at the top level
    text = dict(cfg.get("text_config") or {k: v for k, v in cfg.items() if k != "vision_config"})
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    mrope_section = rope.get("mrope_section")
    if not mrope_section:
        raise UnsupportedModelError(f"{family} config has no mrope_section in rope_parameters / rope_scaling")
    theta = rope.get("rope_theta", text.get("rope_theta", cfg.get("rope_theta", 1000000.0)))
    text.update(model_type="qwen2", rope_parameters={"rope_type": "default", "rope_theta": float(theta)},
                mrope_section=[int(x) for x in mrope_section],
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))))
    text.pop("rope_scaling", None)
    text.pop("rope_theta", None)
    return VLMArgs(family=family, vision=vision_args_from_hf(dict(cfg["vision_config"]), family),
                   image_token_id=int(cfg.get("image_token_id", text.get("image_token_id", 151655))),
                   video_token_id=cfg.get("video_token_id"), text_config=text)


def image_token_id(hf_dir_or_config: Any) -> int:
    """The image placeholder's (`<|image_pad|>`) token id."""
    return read_vlm_config(hf_dir_or_config).image_token_id
