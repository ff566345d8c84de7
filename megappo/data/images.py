"""The image side of a multimodal prompt dataset: reading, resizing and processing images, and the image tokens.

`ImageProcessing` holds a VLM's image processor and image token ids, as the model's kind reads them from its
directory (`ModelKind.image_processing`, `megappo.kinds`; None for a text-only model). For each prompt the
dataset then

- opens every image at load time, reading only its header (`ImageSource.size`): the image's token count follows
  from its size through Qwen's `smart_resize`, so prompt lengths are checked before a run starts, and a missing or
  unreadable file stops the run at once, naming the file, row and column;
- expands each `<image>` placeholder of the rendered prompt text into `<|vision_start|>` + `<|image_pad|>` x
  (patches / merge^2) + `<|vision_end|>` (as the Hugging Face processor does, so the ids are the processor's);
- decodes, resizes and runs the image processor when a batch is collated (`ImageProcessing.inputs`), once per batch:
  engines and trainer take the resulting `MultiModalInputs` and never touch the files.

Resizing is Qwen's: each side rounded to a multiple of patch x merge (28), the area brought into
[data.image_min_pixels, data.image_max_pixels] keeping the aspect ratio, bicubic.
"""
from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from megappo.data.errors import DataError
from megappo.data.multimodal import MultiModalInputs

IMAGE_PLACEHOLDER = "<image>"


@dataclass(frozen=True)
class ImageSource:
    """One image of a row: its encoded bytes or the path of its file, and where it came from (for errors)."""

    data: Optional[bytes]
    path: Optional[str]  # absolute
    file: str  # the Parquet file
    row: int
    column: str

    def error(self, problem: str, fix: str) -> DataError:
        return DataError(self.file, problem, fix, row=self.row, column=self.column)

    def open(self):
        """The PIL image (lazy: only the header is read until it is converted)."""
        from PIL import Image, UnidentifiedImageError

        what = f"image file {self.path}" if self.data is None else "image bytes"
        try:
            return Image.open(io.BytesIO(self.data) if self.data is not None else self.path)
        except FileNotFoundError as e:
            raise self.error(f"{what} not found", "fix the path (a relative one is read from the Parquet file's "
                             "folder) or store the image's bytes") from e
        except (UnidentifiedImageError, OSError, ValueError) as e:
            raise self.error(f"{what} cannot be read as an image ({type(e).__name__}: {e})",
                             "re-encode the image as PNG or JPEG") from e

    def size(self) -> tuple[int, int]:
        """(height, width) in pixels, from the header."""
        img = self.open()
        return img.height, img.width

    def decode(self):
        """The whole image as RGB."""
        img = self.open()
        try:
            return img.convert("RGB")
        except (OSError, ValueError, SyntaxError) as e:
            raise self.error(f"the image is corrupt ({type(e).__name__}: {e})", "re-encode the image") from e


def image_sources(value: Any, parquet_file: str, row: int, column: str) -> list[ImageSource]:
    """A row's `images` cell ([{bytes, path}, ...], None, or []) as ImageSources."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise DataError(parquet_file, f"type {type(value).__name__} where a list of images was expected",
                        "write the column as a list of {bytes, path} structs", row=row, column=column)
    folder = os.path.dirname(os.path.abspath(parquet_file))
    out = []
    for k, item in enumerate(value):
        if isinstance(item, (bytes, bytearray)):
            item = {"bytes": item}
        elif isinstance(item, str):
            item = {"path": item}
        data, path = (item or {}).get("bytes"), (item or {}).get("path")
        if not data and not path:
            raise DataError(parquet_file, f"image {k} has neither bytes nor path", "give each image its encoded "
                            "bytes or a file path", row=row, column=column)
        if not data:
            path = os.path.join(folder, os.path.expanduser(path))
        out.append(ImageSource(bytes(data) if data else None, path if not data else None, parquet_file, row, column))
    return out


class ImageProcessing:
    """A VLM's image processor with the token ids and the resize bounds the dataset uses."""

    def __init__(self, processor, *, image_token: str, vision_start: str, vision_end: str, image_token_id: int,
                 patch_size: int, merge_size: int, min_pixels: int, max_pixels: int):
        if min_pixels < 1 or max_pixels < min_pixels:
            raise ValueError(f"data.image_min_pixels ({min_pixels}) must be >= 1 and at most data.image_max_pixels "
                             f"({max_pixels})")
        self.processor = processor
        self.image_token, self.vision_start, self.vision_end = image_token, vision_start, vision_end
        self.image_token_id = image_token_id
        self.patch_size, self.merge_size = patch_size, merge_size
        self.min_pixels, self.max_pixels = min_pixels, max_pixels

    def resized(self, height: int, width: int) -> tuple[int, int]:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        return smart_resize(height, width, factor=self.patch_size * self.merge_size, min_pixels=self.min_pixels,
                            max_pixels=self.max_pixels)

    def num_tokens(self, source: ImageSource) -> int:
        """The image's `<|image_pad|>` tokens: merged patches of its resized size (header read only)."""
        h, w = source.size()
        try:
            rh, rw = self.resized(h, w)
        except ValueError as e:  # an aspect ratio over 200
            raise source.error(f"the image ({w}x{h}) cannot be resized: {e}", "crop or pad the image") from e
        return (rh // self.patch_size) * (rw // self.patch_size) // (self.merge_size ** 2)

    def expand(self, text: str, counts: Sequence[int], file: str, row: int, column: str, prompt_key: str) -> str:
        """`text` with its i-th `<image>` replaced by the image tokens of `counts[i]` pads."""
        pieces = text.split(IMAGE_PLACEHOLDER)
        if len(pieces) - 1 != len(counts):
            raise DataError(file, f"the prompt has {len(pieces) - 1} '{IMAGE_PLACEHOLDER}' placeholders but the row "
                            f"has {len(counts)} images", f"put one '{IMAGE_PLACEHOLDER}' in the prompt per image of "
                            f"column '{column}', in order", row=row, column=prompt_key)
        out = [pieces[0]]
        for n, piece in zip(counts, pieces[1:]):
            out.append(self.vision_start + self.image_token * n + self.vision_end + piece)
        return "".join(out)

    def inputs(self, sources: Sequence[ImageSource]) -> MultiModalInputs:
        """Decode, resize and process a prompt's images."""
        images = []
        for s in sources:
            img = s.decode()
            h, w = self.resized(img.height, img.width)
            if (h, w) != (img.height, img.width):
                from PIL import Image

                img = img.resize((w, h), Image.Resampling.BICUBIC)
            images.append(img)
        out = self.processor(images=images, return_tensors="pt")
        return MultiModalInputs(pixel_values=out["pixel_values"].float(),
                                image_grid_thw=out["image_grid_thw"].long(), images=images)

    # -- what the prompt dataset asks of a model's image handling (`NoImages` answers for a text model) ----------
    def prompt_images(self, cell: Any, file: str, row: int, column: str) -> Optional[list[ImageSource]]:
        """A row's images (None: no images column, or an empty cell)."""
        return image_sources(cell, file, row, column) or None

    def expand_prompt(self, text: str, sources: Optional[Sequence[ImageSource]], file: str, row: int, column: str,
                      prompt_key: str) -> str:
        """The rendered prompt with each `<image>` expanded into its image tokens (unchanged without images)."""
        if sources is None:
            return text
        return self.expand(text, [self.num_tokens(s) for s in sources], file, row, column, prompt_key)

    def batch_inputs(self, sources: Sequence[Optional[Sequence[ImageSource]]]
                     ) -> Optional[list[Optional[MultiModalInputs]]]:
        """A collated batch's `multi_modal`: each prompt's processed images (None for a prompt without); None for a
        batch without any."""
        if not any(sources):
            return None
        return [self.inputs(s) if s else None for s in sources]


def images_found(sources: Sequence[Optional[Sequence[ImageSource]]]) -> list[str]:
    """The dry run's note on a dataset's images (none for a text dataset)."""
    n = sum(len(s) for s in sources if s)
    return [f"{n} image(s) found"] if n else []


class NoImages:
    """The image handling of a model without a vision tower: its prompts carry no images."""

    def prompt_images(self, cell: Any, file: str, row: int, column: str) -> None:
        sources = image_sources(cell, file, row, column)
        if sources:
            raise DataError(file, f"the row has {len(sources)} images but the model has no vision tower",
                            "train a vision-language model (e.g. Qwen2.5-VL) on this data, or drop the "
                            f"'{column}' column", row=row, column=column)
        return None

    def expand_prompt(self, text: str, sources: None, file: str, row: int, column: str, prompt_key: str) -> str:
        return text

    def batch_inputs(self, sources: Sequence[Optional[Sequence[ImageSource]]]) -> None:
        if any(sources):
            raise ValueError("prompts with images need the model's ImageProcessing to be collated")
        return None
