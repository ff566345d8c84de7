"""Multimodal rotary positions (mrope) of Qwen2-VL / Qwen2.5-VL: [3, B, T] (temporal, height, width) per token.

Text tokens count up by one on all three axes; an image's tokens (merged patches, t x h/m x w/m) take
(start + t, start + row, start + column), and the text after it resumes at start + max(t, h/m, w/m) (for a still
image t = 1 counts as max(h, w)/m; HF's `get_rope_index` for images). Padding (attention_mask 0) gets position 0
and does not advance the count, so left padding leaves the real tokens' positions unchanged.
"""
from __future__ import annotations

from typing import Optional

import torch


def mrope_position_ids(input_ids: torch.Tensor, image_grid_thw: Optional[torch.Tensor], image_token_id: int,
                       spatial_merge_size: int, attention_mask: Optional[torch.Tensor] = None,
                       image_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """input_ids [B, T], image_grid_thw [I, 3] (images in row-major order over the batch) -> position ids [3, B, T].
    image_mask [B, T]: which tokens are image placeholders (default: every image_token_id; the trainer counts only
    the prompt's, so that a sampled image token in a response is text, as the engine decoded it)."""
    b, t = input_ids.shape
    out = torch.zeros(3, b, t, dtype=torch.long, device=input_ids.device)
    grids = iter(image_grid_thw.tolist()) if image_grid_thw is not None else iter(())
    for row in range(b):
        keep = attention_mask[row].bool() if attention_mask is not None else torch.ones(t, dtype=torch.bool)
        marks = image_mask[row] if image_mask is not None else input_ids[row] == image_token_id
        is_image = marks[keep].tolist()
        pieces, pos, i = [], 0, 0
        while i < len(is_image):
            j = i
            while j < len(is_image) and is_image[j] == is_image[i]:
                j += 1
            if not is_image[i]:
                pieces.append(torch.arange(pos, pos + j - i).expand(3, -1))
                pos += j - i
            else:
                done = i
                while done < j:  # consecutive images without text between them
                    gt, gh, gw = next(grids)
                    gh, gw = gh // spatial_merge_size, gw // spatial_merge_size
                    tt, hh, ww = torch.meshgrid(torch.arange(gt), torch.arange(gh), torch.arange(gw), indexing="ij")
                    pieces.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
                    pos += max(gh, gw)
                    done += gt * gh * gw
                if done != j:
                    raise ValueError(f"row {row}: {j - i} image tokens do not match the image grids given")
            i = j
        if pieces:
            out[:, row, keep.to(out.device)] = torch.cat(pieces, dim=1).to(out.device)
    return out
