"""Prompts' images across the pipe to the engine's child process (`process.py` / `child.py`).

They cross as numpy arrays: pickled through the pipe by value, where tensors would go through torch's shared-memory
file descriptors (one per tensor, each a resource the child must take before the parent moves on). The PIL images
stay on the parent's side: the child's engine uses the processed pixels.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from megappo.data.multimodal import MultiModalInputs

PipeImages = Optional[list]  # per prompt: None (text) or (pixel_values, image_grid_thw) as numpy arrays


def images_to_pipe(prompts: Optional[Sequence[Optional[MultiModalInputs]]]) -> PipeImages:
    if prompts is None:
        return None
    return [None if m is None else (m.pixel_values.detach().cpu().numpy(), m.image_grid_thw.cpu().numpy())
            for m in prompts]


def images_from_pipe(arrays: PipeImages) -> Optional[list[Optional[MultiModalInputs]]]:
    if arrays is None:
        return None
    return [None if m is None else MultiModalInputs(torch.from_numpy(m[0]), torch.from_numpy(m[1])) for m in arrays]
