"""A Qwen2-VL / Qwen2.5-VL directory's image processing (`megappo.data.images.ImageProcessing`): its image processor
(`preprocessor_config.json`, else one built from the vision config) and the image token ids of its config. The
dataset only uses what this builds; reading the model's config is the kind's job."""
from __future__ import annotations

import json
import os
from typing import Any, Optional

from megappo.data.images import ImageProcessing

_PROCESSOR_FILE = "preprocessor_config.json"


def image_processing(model_dir: str, tokenizer, *, min_pixels: int, max_pixels: int) -> Optional[ImageProcessing]:
    """The image processing of the VLM in `model_dir`, or None when its config has no vision tower."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from megappo.kinds import kind_of
    from megappo.kinds.qwen2_vl.config import read_vlm_config
    from megappo.models.hf_config import load_hf_config_dict

    if not kind_of(model_dir).multi_modal:
        return None
    args = read_vlm_config(model_dir)
    cfg = load_hf_config_dict(model_dir)
    v = args.vision
    kwargs: dict[str, Any] = {}
    path = os.path.join(model_dir, _PROCESSOR_FILE)
    if os.path.isfile(path):  # the model's own normalisation; its sizes must be the vision tower's
        with open(path, encoding="utf-8") as f:
            kwargs = {k: val for k, val in json.load(f).items() if k in ("image_mean", "image_std",
                                                                          "rescale_factor", "do_normalize")}
    # The PIL backend: the same bicubic resize as the released processor, so pixels match it exactly.
    proc = Qwen2VLImageProcessorPil(patch_size=v.patch_size, merge_size=v.spatial_merge_size,
                                    temporal_patch_size=v.temporal_patch_size, min_pixels=min_pixels,
                                    max_pixels=max_pixels, **kwargs)
    ids = {"image": args.image_token_id, "start": int(cfg.get("vision_start_token_id", 151652)),
           "end": int(cfg.get("vision_end_token_id", 151653))}
    tokens = {k: tokenizer.convert_ids_to_tokens(i) for k, i in ids.items()}
    for k, tok in tokens.items():
        if tok is None or tokenizer.convert_tokens_to_ids(tok) != ids[k]:
            raise ValueError(f"{model_dir}: the tokenizer has no token for the config's {k} id {ids[k]}; use the "
                             "model's own tokenizer (data.tokenizer)")
    return ImageProcessing(proc, image_token=tokens["image"], vision_start=tokens["start"], vision_end=tokens["end"],
                           image_token_id=ids["image"], patch_size=v.patch_size, merge_size=v.spatial_merge_size,
                           min_pixels=min_pixels, max_pixels=max_pixels)
