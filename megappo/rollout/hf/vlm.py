"""The in-process engine's prompt inputs, chosen once from the model: text, or a vision-language model's images.

`prompt_inputs(model)` gives `TextInputs` for a causal LM and `VisionInputs` for a Qwen2-VL / Qwen2.5-VL
(`...ForConditionalGeneration`): the engine asks it to check a request's images (`check`), for a forward batch's
positions and extra model inputs (`prefill`) and for those of a scored prompt (`scoring`). A vision-language
prompt's images go through the vision tower in the prefill, positions are the multimodal rotary ones
(the model kind's `position_ids`, the trainer's), and decoding goes on from the KV cache as for text.

Images cross the pipe to the engine's child process (`process.py` / `child.py`) as numpy arrays (`to_pipe`,
`from_pipe`): pickled through the pipe by value, where tensors would go through torch's shared-memory file
descriptors (one per tensor, each a resource the child must take before the parent moves on). The PIL images stay on
the parent's side: the child's engine uses the processed pixels.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from megappo.data.multimodal import MultiModalInputs, check_entries

MultiModal = Optional[Sequence[Optional[MultiModalInputs]]]  # per prompt: its images, or None (a text prompt)
Rows = list[tuple[int, list[int]]]  # a forward batch's (prompt index, prompt ids)


def _checked(prompts: Sequence[Sequence[int]], multi_modal: MultiModal) -> Optional[list]:
    """`multi_modal` as a list when some prompt has images (None: none has), of one entry per prompt."""
    if multi_modal is None or all(m is None for m in multi_modal):
        return None
    check_entries(multi_modal, len(prompts))
    return list(multi_modal)


class TextInputs:
    """A causal LM's inputs: positions counted from each row's first real token, nothing else."""

    def __init__(self, model_name: str):
        self.model_name = model_name

    def check(self, prompts: Sequence[Sequence[int]], multi_modal: MultiModal) -> None:
        if _checked(prompts, multi_modal) is not None:
            raise ValueError(f"prompts with images were sent to a {self.model_name}, which has no vision "
                             "tower; use a vision-language model (Qwen2-VL / Qwen2.5-VL)")

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, rows: Rows, images: Any, model: Any
                ) -> tuple[torch.Tensor, dict]:
        """(position ids [B, P], extra keyword inputs of the prefill)."""
        return (mask.cumsum(-1) - 1).clamp_(min=0), {}

    def scoring(self, ids: torch.Tensor, token_ids: Sequence[int], multi_modal: Optional[MultiModalInputs],
                model: Any) -> dict:
        """The extra keyword inputs of scoring one prompt `ids` [1, P]."""
        return {}


class VisionInputs(TextInputs):
    """A Qwen2(.5)-VL's inputs: its image token and spatial merge size check the images against the prompts."""

    def __init__(self, model_name: str, image_token: int, merge: int, positions: Any):
        super().__init__(model_name)
        self.image_token, self.merge = image_token, merge
        self.positions = positions  # the model kind's multimodal rotary positions (`ModelKind.position_ids`)

    def check(self, prompts: Sequence[Sequence[int]], multi_modal: MultiModal
              ) -> Optional[list[Optional[MultiModalInputs]]]:
        """`multi_modal` checked against the prompts (None when no prompt has images)."""
        images = _checked(prompts, multi_modal)
        for k, (p, m) in enumerate(zip(prompts, images or [])):
            want = 0 if m is None else int(m.image_grid_thw.prod(-1).sum()) // self.merge ** 2
            have = sum(1 for t in p if t == self.image_token)
            if have != want:
                raise ValueError(f"prompt {k} holds {have} image tokens but its images need {want}; the prompt ids "
                                 "and the images must come from the same data loader batch")
        return images

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, rows: Rows,
                images: Optional[list[Optional[MultiModalInputs]]], model: Any) -> tuple[torch.Tensor, dict]:
        """(multimodal rotary positions [3, B, P], the prefill's pixel_values / image_grid_thw); decoding continues
        on all three axes."""
        mms = [images[i] for i, _ in rows] if images is not None else []
        mms = [m for m in mms if m is not None]
        grid = torch.cat([m.image_grid_thw for m in mms]) if mms else None
        pos = self.positions(ids.cpu(), grid, self.image_token, self.merge, mask.cpu()).to(ids.device)
        if not mms:
            return pos, {}
        pixels = torch.cat([m.pixel_values for m in mms]).to(ids.device, model.dtype)
        return pos, {"pixel_values": pixels, "image_grid_thw": grid.to(ids.device)}

    def scoring(self, ids: torch.Tensor, token_ids: Sequence[int], multi_modal: Optional[MultiModalInputs],
                model: Any) -> dict:
        images = self.check([token_ids], [multi_modal])
        pos, kw = self.prefill(ids, torch.ones_like(ids), [(0, [])], images, model)
        return {"position_ids": pos, **kw}


def prompt_inputs(model: Any) -> TextInputs:
    """The inputs of `model` (a transformers model): `VisionInputs` when its config has a vision tower."""
    config, name = model.config, type(model).__name__
    if getattr(config, "vision_config", None) is None:
        return TextInputs(name)
    from megappo.kinds import kind_of

    return VisionInputs(name, int(config.image_token_id), int(config.vision_config.spatial_merge_size),
                        kind_of(config).position_ids)


def to_pipe(multi_modal: MultiModal, num_prompts: int) -> Optional[list]:
    """Prompts' images as numpy arrays, per prompt None or (pixel_values, image_grid_thw)."""
    if multi_modal is None:
        return None
    check_entries(multi_modal, num_prompts)
    return [None if m is None else (m.pixel_values.detach().cpu().numpy(), m.image_grid_thw.cpu().numpy())
            for m in multi_modal]


def from_pipe(arrays: Optional[list]) -> Optional[list[Optional[MultiModalInputs]]]:
    if arrays is None:
        return None
    return [None if m is None else MultiModalInputs(torch.from_numpy(m[0]), torch.from_numpy(m[1])) for m in arrays]


def one_to_pipe(multi_modal: Optional[MultiModalInputs]) -> Optional[list]:
    """One scored prompt's images across the pipe (`prompt_log_probs`)."""
    return None if multi_modal is None else to_pipe([multi_modal], 1)


def one_from_pipe(arrays: Optional[list]) -> Optional[MultiModalInputs]:
    images = from_pipe(arrays)
    return images[0] if images else None
