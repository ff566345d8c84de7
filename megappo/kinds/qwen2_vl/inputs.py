"""A micro-batch's image inputs for a `VLMModel`: pixel values, image grids and multimodal rotary positions.

A `ModelBatch` carries `multi_modal`: one `MultiModalInputs` (or None, a text-only row) per row, so that selecting,
cropping and padding rows (micro-batching, dynamic batch sizes, the data-parallel split) keeps each row's images
with it. The model gets them concatenated in row order, the order in which `VLMModel.embed` fills the image
placeholders of its [b, s] (or packed [1, T]) input ids.

Positions. The compute code runs left-aligned rows (each row's real tokens in columns 0..L_i-1, padding after) or
one pack of the rows' real tokens. The mrope positions [3, b, s] are computed per row over its real tokens only, so
they restart at 0 for every sequence; packed, each row's positions are taken in pack order and concatenated
([3, 1, T], 0 on the pack's tail padding), and megatron's THD rotary code reads one position per packed token.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from megappo.data.multimodal import MultiModalInputs

__all__ = ["vlm_inputs", "micro_batch_inputs"]


def _images(rows: Sequence[Optional[MultiModalInputs]],
            device) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(pixel_values [N, D], image_grid_thw [I, 3]) of the rows in order; (None, None) without images."""
    present = [m for m in rows if m is not None and m.num_images > 0]
    if not present:
        return None, None
    pixels = torch.cat([m.pixel_values for m in present]).to(device)
    grids = torch.cat([m.image_grid_thw.to(torch.long) for m in present]).to(device)
    return pixels, grids


def vlm_inputs(model: Any, rows: Optional[Sequence[Optional[MultiModalInputs]]], input_ids: torch.Tensor,
               lengths: torch.Tensor, prompt_lengths: torch.Tensor, pack: Any = None) -> dict[str, Any]:
    """Keyword arguments of `VLMModel.forward` for a micro-batch.

    input_ids: the left-aligned rows [b, s] (row i's real tokens in columns 0..lengths[i]-1, its prompt the first
    prompt_lengths[i]); rows: the micro-batch's `multi_modal` (None: text only); pack: the micro-batch's `Pack` when
    it runs packed. Returns position_ids ([3, b, s], or [3, 1, T] packed), pixel_values and image_grid_thw (None
    without images) and image_mask: the prompts' image tokens only. A response may hold a sampled image token; the
    engine decoded it as text (no pixels, the next text position), and so does the trainer."""
    rows = list(rows) if rows is not None else [None] * input_ids.shape[0]
    if len(rows) != input_ids.shape[0]:
        raise ValueError(f"a micro-batch of {input_ids.shape[0]} rows carries images for {len(rows)}")
    pixels, grids = _images(rows, input_ids.device)
    cols = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
    keep = cols < lengths.to(input_ids.device)[:, None]
    image_mask = (input_ids == model.vlm_args.image_token_id) & (cols < prompt_lengths.to(input_ids.device)[:, None])
    positions = model.mrope_positions(input_ids, grids, keep.long(), image_mask)  # [3, b, s], per row from 0
    if pack is not None:
        flat, flat_mask = positions[:, keep], image_mask[keep]  # row-major: the pack's order
        tail = pack.num_tokens - flat.shape[1]
        if tail:
            flat = torch.cat([flat, flat.new_zeros(3, tail)], dim=1)
            flat_mask = torch.cat([flat_mask, flat_mask.new_zeros(tail)])
        positions, image_mask = flat.unsqueeze(1), flat_mask.unsqueeze(0)  # [3, 1, T], [1, T]
    return {"position_ids": positions, "pixel_values": pixels, "image_grid_thw": grids, "image_mask": image_mask}


def micro_batch_inputs(model: Any, mb: Any, layout: Any) -> dict[str, Any]:
    """`VLMModel.micro_batch_inputs`: the keyword arguments a `VLMModel` takes beyond its layout's
    (`megappo.models.layout.plan`) for a `ModelBatch` micro-batch: its images and mrope positions (`vlm_inputs`,
    replacing the layout's position ids)."""
    from megappo.models.layout.packing import pack_lengths

    input_ids, _ = mb.left_aligned()
    return vlm_inputs(model, mb.multi_modal, input_ids, pack_lengths(mb), mb.prompt_lengths(), layout.pack)
