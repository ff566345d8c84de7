"""Image inputs of a vision-language prompt, as they travel from the data loader to the engines and the trainer.

Parquet schema (verl's multimodal one): a row's `prompt` is a chat message list whose user content holds one
`<image>` placeholder per image, in order; its `images` column is a list of `{"bytes": <encoded image> | None,
"path": <file path> | None}` (one of the two set; a relative path is read from the Parquet file's folder). The other
columns are the text schema's (data_source, ability, reward_model.ground_truth, extra_info).

The data loader decodes and resizes every image once (Qwen's processor min/max pixels), runs the model's image
processor and expands each `<image>` into `<|vision_start|>` + `<|image_pad|>` x (patches / merge^2) +
`<|vision_end|>` in the prompt's token ids; what it hands on per prompt is a `MultiModalInputs`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class MultiModalInputs:
    """One prompt's images after the image processor (the prompt's ids already hold their image tokens)."""

    pixel_values: torch.Tensor  # [N, C * temporal_patch * patch * patch] float32, the patches of all images in order
    image_grid_thw: torch.Tensor  # [I, 3] int64, (t, h, w) in patches per image; N = sum(t * h * w)
    images: Optional[list] = None  # I decoded, resized RGB PIL images (for engines that take raw images: SGLang)

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])
