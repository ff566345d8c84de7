"""Qwen2.5-VL at TP2 x PP2 (4 gloo ranks): the vision tower on the first stage split over TP, the mrope language
model over both; logits on real image inputs of different sizes equal transformers' within 1e-4 (float32), and the
export gathers the HF checkpoint back bit for bit. Qwen2-VL's run is `long` (the TP1 test covers its mapping).
"""
from __future__ import annotations

import pytest
import torch

from megappo.testing.dist import run_distributed

pytestmark = pytest.mark.multirank


def _job(rank, world_size, hf_dir, batch, tp, pp):
    from megappo.convert.export import hf_state_dict
    from megappo.convert.hf_io import read_json_object
    from megappo.convert.hf_to_mcore import load_hf_weights
    from megappo.convert.vlm_verify import vlm_mcore_forward
    from megappo.models.builder import build_model
    from megappo.parallel import destroy_parallel, init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout

    plat = detect_platform()
    ps = init_parallel(ParallelLayout(tp=tp, pp=pp), plat, seed=0)
    chunks = build_model(hf_dir, "actor", ps, plat)
    load_hf_weights(chunks, hf_dir, ps)
    has_vision = chunks[0].vision_model is not None
    logits = vlm_mcore_forward(chunks, ps, batch, vocab_size=512)
    exported = hf_state_dict(chunks, ps, read_json_object(f"{hf_dir}/config.json", "config"))
    destroy_parallel()
    return {"logits": logits, "exported": exported if rank == 0 else None, "has_vision": has_vision}


@pytest.mark.parametrize("family", ["qwen2_5_vl", pytest.param("qwen2_vl", marks=pytest.mark.long)])
def test_vlm_tp2_pp2_matches_transformers(tmp_path, family):
    from safetensors.torch import load_file

    from megappo.convert.vlm_verify import hf_vlm_forward
    from megappo.testing.vlm_models import image_batch, make_hf_vlm

    hf_dir = make_hf_vlm(str(tmp_path / family), family)
    batch = image_batch(hf_dir)
    outs = run_distributed(_job, 4, hf_dir, batch, 2, 2, timeout=400)
    # ranks 0, 1 are the first stage (TP 0 and 1): only they hold the vision tower
    assert [o["has_vision"] for o in outs] == [True, True, False, False]
    ref = hf_vlm_forward(hf_dir, batch)
    real = batch["attention_mask"].bool()
    for o in outs:
        torch.testing.assert_close(o["logits"][real], ref[real], rtol=0, atol=1e-4)
    saved = load_file(f"{hf_dir}/model.safetensors")
    exported = outs[0]["exported"]
    assert set(exported) == set(saved)
    assert all(torch.equal(exported[k], saved[k]) for k in saved), "TP2 x PP2 export is not bit-exact"
