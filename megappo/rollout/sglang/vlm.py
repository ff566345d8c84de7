"""What a vision-language model changes in SGLang's engine and servers.

Prompts: SGLang runs the model's image processor itself and expands each image's one `<|image_pad|>` into the
image's tokens, so a prompt of the data loader (pads already expanded) is sent with each run of pads collapsed to
one, and its images (`MultiModalInputs.images`, already resized) as base64 PNG `image_data` (`sglang_prompts`); the
engine needs the model's `image_token_id` for that (`image_token_id(model_path)`).

Servers (`server_options`): on CPU a vision-language model is launched through `cpu_vlm.py`, and SGLang's cache of
images' vision-tower embeddings is turned off.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

from megappo.kinds import kind_of

if TYPE_CHECKING:
    from megappo.data.multimodal import MultiModalInputs

ImageData = Optional[list[str]]  # one prompt's images as SGLang's /generate takes them (None: a text prompt)
_CPU_VLM_LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_vlm.py")


def _data_uri(image) -> str:
    import base64
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")  # lossless: the server sees the loader's pixels
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def sglang_prompts(prompts: Sequence[Sequence[int]], multi_modal: Optional[Sequence[Optional["MultiModalInputs"]]],
                   image_token_id: Optional[int]) -> tuple[list[list[int]], Optional[list[ImageData]]]:
    """The prompts as SGLang takes them: each run of image tokens collapsed to one (SGLang expands it again from
    the image it processes), and each prompt's images as base64 PNG data URIs (None when no prompt has images)."""
    from megappo.data.multimodal import collapse_image_runs

    prompts = [list(p) for p in prompts]
    if multi_modal is None or all(m is None for m in multi_modal):
        return prompts, None
    ids = collapse_image_runs(prompts, multi_modal, image_token_id, "SGLang")
    return ids, [None if m is None else [_data_uri(img) for img in m.images] for m in multi_modal]


def row_images(images: Optional[list[ImageData]], prompt_of_row: Sequence[int]) -> Optional[list[ImageData]]:
    """The images of each row (its prompt's; None for a text generation)."""
    return None if images is None else [images[i] for i in prompt_of_row]


def add_image_data(body: dict, image_data: Optional[Sequence[ImageData]], batched: bool) -> None:
    """Put the rows' images in a /generate request body when any row has some (a text request stays as it was)."""
    if image_data is not None and any(i is not None for i in image_data):
        body["image_data"] = list(image_data) if batched else image_data[0]


def image_token_id(model_path: str) -> Optional[int]:
    """A vision-language model's image token id (the fleet collapses each image's tokens to it), else None."""
    return kind_of(model_path).image_token_id(model_path)


@dataclass
class ServerOptions:
    """What the model adds to an SGLang server's start: another launcher, flags, environment defaults."""

    launcher: Optional[list[str]] = None  # None: `-m sglang.launch_server`
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # set unless the environment has them


def server_options(model_path: str, cuda: bool) -> ServerOptions:
    if not kind_of(model_path).multi_modal:
        return ServerOptions()
    # SGLang keeps images' vision-tower embeddings in a cache that neither a weight update nor /flush_cache
    # clears (SGLang 0.5.23), so after a sync that changed the vision tower it would answer with the old
    # tower's embeddings (measured: other tokens than an engine on the new weights); 0 MB turns it off
    env = {"SGLANG_VLM_CACHE_SIZE_MB": "0"}
    if cuda:
        return ServerOptions(env=env)
    # cpu_vlm.py lets SGLang's Qwen-VL image processor import on CPU (see there); the warm-up request goes through a
    # chat template, which a tiny test model lacks (megappo's health check is a one-token generation anyway)
    return ServerOptions(["-c", f"import runpy; runpy.run_path({_CPU_VLM_LAUNCHER!r}, run_name='__main__')"],
                         ["--skip-server-warmup"], env)
