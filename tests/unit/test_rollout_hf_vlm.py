"""The in-process engine on a tiny Qwen2.5-VL: greedy tokens from image prompts (left-padded, batched with a text
prompt) equal transformers' own generate per prompt, its log-probs equal the HF model's forward, and a weight sync
by the checkpoint names the VLM export writes (`model.layers.*`, `visual.*`) reproduces another model."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megappo.data.multimodal import MultiModalInputs
from megappo.rollout import HFEngine, SamplingParams
from megappo.testing.vlm_models import IMAGE_TOKEN, VISION_END, VISION_START, make_hf_vlm

torch.set_num_threads(1)
GREEDY = SamplingParams(max_new_tokens=6, temperature=0)


@pytest.fixture(scope="module")
def vlm_dirs(tmp_path_factory):
    a = make_hf_vlm(str(tmp_path_factory.mktemp("vlm_a")), seed=0, eos_token_id=2, pad_token_id=0)
    b = make_hf_vlm(str(tmp_path_factory.mktemp("vlm_b")), seed=1, eos_token_id=2, pad_token_id=0)
    return a, b


def _inputs():
    """Two image prompts (one image of 4x6 patches; two of 6x4 and 4x4) and a text prompt."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    proc = Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=28 * 28,
                                    max_pixels=28 * 28 * 16)
    rng = np.random.default_rng(0)

    def mm(*sizes):
        out = proc(images=[rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes], return_tensors="pt")
        return MultiModalInputs(out["pixel_values"], out["image_grid_thw"])

    def block(grid):
        return [VISION_START] + [IMAGE_TOKEN] * (int(grid.prod()) // 4) + [VISION_END]

    one, two = mm((56, 84)), mm((84, 56), (56, 56))
    prompts = [[7, 8] + block(one.image_grid_thw[0]) + [9, 10, 11],
               [12] + block(two.image_grid_thw[0]) + [13] + block(two.image_grid_thw[1]) + [14, 15],
               [16, 17, 18, 19]]
    return prompts, [one, two, None]


def _hf_greedy(model, prompt, mm):
    ids = torch.tensor([prompt])
    kw = {} if mm is None else dict(pixel_values=mm.pixel_values, image_grid_thw=mm.image_grid_thw,
                                    mm_token_type_ids=(ids == IMAGE_TOKEN).int())
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=GREEDY.max_new_tokens, **kw)
    return out[0, len(prompt):].tolist()


def test_vlm_engine_equals_transformers(vlm_dirs):
    import transformers

    a, b = vlm_dirs
    prompts, mms = _inputs()
    engine = HFEngine(a)
    result = engine.generate(prompts, GREEDY, multi_modal=mms)
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(a, dtype=torch.float32).eval()
    for prompt, mm, (c,) in zip(prompts, mms, result):
        assert len(c.output_ids) == GREEDY.max_new_tokens
        assert c.output_ids == _hf_greedy(model, prompt, mm)
        # the sampled tokens' log-probs are the HF model's on prompt + response
        ids = torch.tensor([prompt + c.output_ids])
        kw = {} if mm is None else dict(pixel_values=mm.pixel_values, image_grid_thw=mm.image_grid_thw,
                                        mm_token_type_ids=(ids == IMAGE_TOKEN).int())
        with torch.no_grad():
            logits = model(input_ids=ids, **kw).logits[0, len(prompt) - 1:-1]
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.output_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(c.log_probs), want, atol=1e-4)
        scored = engine.prompt_log_probs(prompt + c.output_ids, multi_modal=mm)[0][len(prompt) - 1:]
        assert np.allclose(scored, want.numpy(), atol=1e-4)

    # the images matter: the same ids without the first prompt's pixels are refused, other pixels answer otherwise
    with pytest.raises(ValueError, match="prompt 0 holds 6 image tokens but its images need 0"):
        engine.generate(prompts, GREEDY, multi_modal=[None, mms[1], None])

    # weight sync by checkpoint names: the engine then generates what an engine loaded from `b` does
    engine.update_weights_from_disk(b, version=3)
    fresh = HFEngine(b).generate(prompts, GREEDY, multi_modal=mms)
    synced = engine.generate(prompts, GREEDY, multi_modal=mms)
    assert [c[0].output_ids for c in synced] == [c[0].output_ids for c in fresh]
    assert [c[0].output_ids for c in synced] != [c[0].output_ids for c in result]
    assert synced[0][0].weight_version == 3


def test_text_engine_refuses_images(hf_model_dir):
    prompts, mms = _inputs()
    with pytest.raises(ValueError, match="no vision tower"):
        HFEngine(hf_model_dir("qwen2")).generate(prompts[:1], GREEDY, multi_modal=mms[:1])


def test_vlm_engine_in_its_own_process(vlm_dirs):
    """Images cross the process boundary; a weight sync in buckets of checkpoint names reaches the child."""
    from safetensors.torch import load_file

    from megappo.rollout.hf.process import HFProcessEngine

    a, b = vlm_dirs
    prompts, mms = _inputs()
    want = HFEngine(a).generate(prompts, SamplingParams(max_new_tokens=4, temperature=1.0, seed=7, n=2),
                                multi_modal=mms)
    with HFProcessEngine(a, threads=1) as proc:
        got = proc.submit(prompts, SamplingParams(max_new_tokens=4, temperature=1.0, seed=7, n=2),
                          multi_modal=mms).result(timeout=120)
        assert [[c.output_ids for c in g] for g in got] == [[c.output_ids for c in g] for g in want]
        full = prompts[1] + got[1][0].output_ids
        assert np.allclose(proc.prompt_log_probs(full, multi_modal=mms[1])[0][-4:], got[1][0].log_probs, atol=1e-4)
        weights = sorted(load_file(f"{b}/model.safetensors").items())
        proc.pause()
        proc.load_weights([weights[:20], weights[20:]], version=2)
        proc.resume()
        synced = proc.generate(prompts, GREEDY, multi_modal=mms)
    fresh = HFEngine(b).generate(prompts, GREEDY, multi_modal=mms)
    assert [c[0].output_ids for c in synced] == [c[0].output_ids for c in fresh]
    assert synced[0][0].weight_version == 2


def test_sglang_requests_carry_one_image_token_per_image_and_the_images():
    """SGLang expands each image's one <|image_pad|> itself from the image it processes: the prompts go with each
    run of image tokens collapsed, and the loader's resized images as base64 PNG (the same pixels)."""
    import base64
    import io

    from PIL import Image

    from megappo.rollout.sglang.vlm import sglang_prompts

    prompts, mms = _inputs()
    for m in mms[:2]:
        m.images = [Image.fromarray(np.full((28 * h, 28 * w, 3), 40 * k, dtype=np.uint8))
                    for k, (_, h, w) in enumerate(m.image_grid_thw.tolist())]
    ids, images = sglang_prompts(prompts, mms, IMAGE_TOKEN)
    assert ids[0] == [7, 8, VISION_START, IMAGE_TOKEN, VISION_END, 9, 10, 11]
    assert ids[1] == [12, VISION_START, IMAGE_TOKEN, VISION_END, 13, VISION_START, IMAGE_TOKEN, VISION_END, 14, 15]
    assert ids[2] == prompts[2] and images[2] is None and len(images[1]) == 2
    head, data = images[1][1].split(",", 1)
    assert head == "data:image/png;base64"
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(base64.b64decode(data)))), np.asarray(mms[1].images[1]))
    assert sglang_prompts(prompts, None, None) == (prompts, None)
    with pytest.raises(ValueError, match="image_token_id"):
        sglang_prompts(prompts, mms, None)
