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
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

if TYPE_CHECKING:  # light to import: the Parquet schema checks read this module before torch loads
    import torch


def check_entries(multi_modal: Sequence[Any], num_prompts: int) -> None:
    """Refuse images that are not one entry (None: a text prompt) per prompt."""
    if len(multi_modal) != num_prompts:
        raise ValueError(f"multi_modal has {len(multi_modal)} entries for {num_prompts} prompts")


@dataclass
class MultiModalInputs:
    """One prompt's images after the image processor (the prompt's ids already hold their image tokens)."""

    pixel_values: torch.Tensor  # [N, C * temporal_patch * patch * patch] float32, the patches of all images in order
    image_grid_thw: torch.Tensor  # [I, 3] int64, (t, h, w) in patches per image; N = sum(t * h * w)
    images: Optional[list] = None  # I decoded, resized RGB PIL images (for engines that take raw images: SGLang)

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])


def collapse_image_runs(prompts: Sequence[Sequence[int]], multi_modal: Sequence[Optional[MultiModalInputs]],
                        image_token_id: Optional[int], engine: str) -> list[list[int]]:
    """The prompts as an engine that runs the model's image processor itself takes them (SGLang, vLLM): each run of
    image tokens collapsed to the one `<|image_pad|>` the engine expands again from the image it processes. Each
    prompt with images must hold one run per decoded image (`MultiModalInputs.images`), a text prompt none."""
    check_entries(multi_modal, len(prompts))
    if image_token_id is None:
        raise ValueError(f"prompts with images need the {engine} engine's image_token_id (the model config's)")
    out = []
    for k, (p, m) in enumerate(zip(prompts, multi_modal)):
        ids = [int(t) for j, t in enumerate(p) if t != image_token_id or j == 0 or p[j - 1] != image_token_id]
        runs = sum(1 for t in ids if t == image_token_id)
        if m is None:
            if runs:
                raise ValueError(f"prompt {k} holds image tokens but has no images")
            out.append([int(t) for t in p])
            continue
        if m.images is None or len(m.images) != m.num_images or runs != m.num_images:
            raise ValueError(f"prompt {k}: {runs} runs of image tokens, {m.num_images} images, "
                             f"{'no' if m.images is None else len(m.images)} decoded images; {engine} needs the "
                             "data loader's decoded images (MultiModalInputs.images), one per run of image tokens")
        out.append(ids)
    return out


def check_images_column(schema: Any, image_key: str, wrong: Callable[[str, str], Exception]) -> None:
    """Raise `wrong(column, expected)` when a Parquet schema's images column (if it has one) is no list."""
    import pyarrow as pa

    if image_key in schema.names:
        t = schema.field(image_key).type
        if not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_null(t)):
            raise wrong(image_key, "a list of {bytes, path} structs (one per <image> of the prompt)")


def select_rows(multi_modal: Optional[Sequence[Optional[MultiModalInputs]]],
                rows: Sequence[int]) -> Optional[list[Optional[MultiModalInputs]]]:
    """The entries at `rows` of a batch's per-row images (None: a text batch, which stays None)."""
    return None if multi_modal is None else [multi_modal[r] for r in rows]


def batch_images(per_sample: Sequence[Optional[MultiModalInputs]],
                 rows: Sequence[int]) -> Optional[list[Optional[MultiModalInputs]]]:
    """A model batch's `multi_modal` for the samples at `rows`: their images, one entry per row, when any sample
    has images (each row keeps its prompt's images through micro-batching); None for text samples."""
    return [per_sample[r] for r in rows] if any(m is not None for m in per_sample) else None


def refuse_images(multi_modal: Optional[Sequence[Optional[MultiModalInputs]]]) -> None:
    """ValueError for a batch with images given to a text-only model."""
    if multi_modal is not None:
        raise ValueError("a batch with images (multi_modal) needs a vision-language model; this model is text-only")


# -- a checkpoint's not-yet-trained samples (trainer_state.json) carry their images as JSON ------------------------

def _tensor_to_json(t: torch.Tensor) -> dict:
    import base64

    a = t.detach().cpu().contiguous().numpy()
    return {"dtype": str(a.dtype), "shape": list(a.shape), "data": base64.b64encode(a.tobytes()).decode("ascii")}


def _tensor_from_json(d: dict) -> torch.Tensor:
    import base64

    import numpy as np
    import torch

    a = np.frombuffer(base64.b64decode(d["data"]), dtype=np.dtype(d["dtype"])).reshape(d["shape"])
    return torch.from_numpy(a.copy())


def multi_modal_to_json(m: Optional[MultiModalInputs]) -> Optional[dict]:
    """A JSON-able form of one sample's images, bit for bit (the decoded PIL images, for engines only, are not kept:
    a saved sample is already generated)."""
    if m is None:
        return None
    return {"pixel_values": _tensor_to_json(m.pixel_values), "image_grid_thw": _tensor_to_json(m.image_grid_thw)}


def multi_modal_from_json(d: Any) -> Optional[MultiModalInputs]:
    if d is None or isinstance(d, MultiModalInputs):
        return d
    return MultiModalInputs(pixel_values=_tensor_from_json(d["pixel_values"]),
                            image_grid_thw=_tensor_from_json(d["image_grid_thw"]))
