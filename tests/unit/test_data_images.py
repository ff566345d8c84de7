"""The multimodal prompt loader: images from bytes and from (relative) paths, resized, processed and expanded into
image tokens exactly as the Hugging Face Qwen2-VL processor does, and the errors a bad multimodal file raises."""
from __future__ import annotations

import io
import os

import numpy as np
import pytest
import torch

from megappo.data import DataError, PromptDataset
from megappo.kinds.qwen2_vl.images import image_processing

SIZES = ((56, 84), (130, 70), (300, 200))  # (height, width): resized to 56x84, 140x56 and a max_pixels-bound size
MIN_PIXELS, MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 30


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    """A tiny Qwen2.5-VL directory with a tokenizer that has the vision tokens (the colour_square task's files,
    without the warm start)."""
    from megappo.tasks.colour_square import TASKS, write_model_files

    out = str(tmp_path_factory.mktemp("vlm"))
    tokenizer, _ = write_model_files(TASKS["colour_square"], out)
    return out, tokenizer


def _image(h: int, w: int, seed: int):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _write(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("data_source", pa.string()),
                        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
                        ("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
                        ("reward_model", pa.struct([("ground_truth", pa.string())]))])
    table = [{"data_source": "t", "prompt": [{"role": "user", "content": text}], "images": images,
              "reward_model": {"ground_truth": "x"}} for text, images in rows]
    pq.write_table(pa.Table.from_pylist(table, schema=schema), path)
    return str(path)


def _dataset(path, vlm, **kw):
    model_dir, tokenizer = vlm
    images = image_processing(model_dir, tokenizer, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    return PromptDataset(path, tokenizer, max_prompt_length=256, image_processing=images, **kw)


def test_bytes_and_paths_match_the_hf_processor(tmp_path, vlm_dir):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    imgs = [_image(h, w, k) for k, (h, w) in enumerate(SIZES)]
    os.makedirs(tmp_path / "pics")
    imgs[1].save(tmp_path / "pics" / "b.png")
    imgs[2].convert("L").save(tmp_path / "c.jpg", quality=95)  # greyscale JPEG: converted to RGB
    rows = [("<image> which colour?", [{"bytes": _png(imgs[0]), "path": None}]),
            ("is <image> the <image> square", [{"bytes": None, "path": "pics/b.png"},
                                                {"bytes": None, "path": str(tmp_path / "c.jpg")}]),
            ("which colour", [])]  # a text prompt in a multimodal file
    ds = _dataset(_write(tmp_path / "mm.parquet", rows), vlm_dir)
    batch = ds.collate([0, 1, 2])
    assert batch.multi_modal is not None and batch.multi_modal[2] is None

    from PIL import Image

    expected_imgs = [[imgs[0]], [imgs[1], Image.open(tmp_path / "c.jpg").convert("RGB")]]
    hf = Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=MIN_PIXELS,
                                  max_pixels=MAX_PIXELS)
    _, tokenizer = vlm_dir
    pad, start, end = (tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|vision_start|>",
                                                                    "<|vision_end|>"))
    for b, images in enumerate(expected_imgs):
        want = hf(images=images, return_tensors="pt")
        mm = batch.multi_modal[b]
        assert torch.equal(mm.image_grid_thw, want["image_grid_thw"])
        assert torch.equal(mm.pixel_values, want["pixel_values"])
        ids = batch.input_ids[b][batch.attention_mask[b].bool()].tolist()
        # one block of <|vision_start|> + t*h*w/4 pads + <|vision_end|> per image, in placeholder order
        blocks, k = [], 0
        while k < len(ids):
            if ids[k] == start:
                e = ids.index(end, k)
                assert set(ids[k + 1:e]) == {pad}
                blocks.append(e - k - 1)
                k = e
            k += 1
        assert blocks == [int(g.prod()) // 4 for g in want["image_grid_thw"]]
    assert batch.multi_modal[0].image_grid_thw.tolist() == [[1, 4, 6]]  # 56x84 px in 14 px patches
    assert batch.multi_modal[1].image_grid_thw[0].tolist() == [1, 10, 4]  # 130x70 rounded to 140x56
    assert max(h * w for _, h, w in batch.multi_modal[1].image_grid_thw.tolist()) * 196 <= MAX_PIXELS
    assert len(batch.multi_modal[1].images) == 2  # the resized PIL images, for engines that take images
    picked = batch.select([1])
    assert picked.multi_modal[0] is batch.multi_modal[1]


def test_bad_multimodal_files_name_row_and_fix(tmp_path, vlm_dir):
    good = [{"bytes": _png(_image(56, 56, 0)), "path": None}]
    path = _write(tmp_path / "corrupt.parquet", [("<image> a", good), ("<image> b", [{"bytes": b"\x89PNGnope",
                                                                                    "path": None}])])
    with pytest.raises(DataError, match=r"corrupt.parquet, row 1, column 'images': image bytes cannot be read"):
        _dataset(path, vlm_dir)
    # a whole header over cut-off pixel data loads (the size is known) and fails when its batch is decoded
    cut = _png(_image(56, 56, 1))[:100]
    rows = [("<image> a", good), ("<image> b", [{"bytes": cut, "path": None}])]
    ds = _dataset(_write(tmp_path / "cut.parquet", rows), vlm_dir)
    ds.collate([0])
    with pytest.raises(DataError, match=r"cut.parquet, row 1, column 'images': the image is corrupt"):
        ds.collate([0, 1])
    path = _write(tmp_path / "missing.parquet", [("<image> a", [{"bytes": None, "path": "nowhere.png"}])])
    with pytest.raises(DataError, match=r"row 0, column 'images': image file .*nowhere.png not found"):
        _dataset(path, vlm_dir)
    path = _write(tmp_path / "count.parquet", [("<image> a <image>", good)])
    with pytest.raises(DataError, match=r"row 0, column 'prompt': the prompt has 2 '<image>' placeholders but the row "
                                        r"has 1 images"):
        _dataset(path, vlm_dir)
    path = _write(tmp_path / "text_model.parquet", [("<image> a", good)])
    _, tokenizer = vlm_dir
    with pytest.raises(DataError, match=r"row 0, column 'images': the row has 1 images but the model has no vision "
                                        r"tower"):
        PromptDataset(path, tokenizer, max_prompt_length=256)
    path = _write(tmp_path / "long.parquet", [("<image> a", good)])
    images = image_processing(vlm_dir[0], tokenizer, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    with pytest.raises(DataError, match="prompts with images are never cut"):
        PromptDataset(path, tokenizer, max_prompt_length=3, truncation="left", image_processing=images)
