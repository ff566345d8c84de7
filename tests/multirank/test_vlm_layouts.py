"""Qwen2.5-VL at TP2 x PP2 (4 gloo ranks): the vision tower on the first stage split over TP, the mrope language
model over both; logits on real image inputs of different sizes equal transformers' within 1e-4 (float32), and the
live export (`iter_hf_weights`, the weight-sync path) gives the HF checkpoint back bit for bit.

`long`: the same through the conversion commands (streaming `hf-to-mcore` at TP2 x PP2 into a dist_checkpoint that
the model loads, streamed `mcore-to-hf` bit for bit), and Qwen2-VL's run (the TP1 test covers its mapping).
"""
from __future__ import annotations

import pytest
import torch

from megappo.testing.dist import run_distributed

pytestmark = pytest.mark.multirank


def _job(rank, world_size, hf_dir, mcore_dir, batch, tp, pp):
    from megappo.convert.hf_io import read_json_object
    from megappo.kinds.build import build_model
    from megappo.kinds.commands import hf_to_mcore
    from megappo.kinds.qwen2_vl.verify import vlm_mcore_forward
    from megappo.kinds.weights import hf_state_dict, load_hf_weights
    from megappo.models.checkpoint import load_model_checkpoint
    from megappo.parallel import destroy_parallel, init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout

    if mcore_dir:
        hf_to_mcore(hf_dir, mcore_dir, tp=tp, pp=pp, progress=False)
    plat = detect_platform()
    ps = init_parallel(ParallelLayout(tp=tp, pp=pp), plat, seed=0)
    chunks = build_model(hf_dir, "actor", ps, plat, seed=1)  # other random weights: the load must replace them
    if mcore_dir:
        load_model_checkpoint(chunks, mcore_dir)
    else:
        load_hf_weights(chunks, hf_dir, ps)
    has_vision = chunks[0].vision_model is not None
    logits = vlm_mcore_forward(chunks, ps, batch, vocab_size=512)
    exported = hf_state_dict(chunks, ps, read_json_object(f"{hf_dir}/config.json", "config"))
    destroy_parallel()
    return {"logits": logits, "exported": exported if rank == 0 else None, "has_vision": has_vision}


def _check(tmp_path, family, via_commands):
    from safetensors.torch import load_file

    from megappo.kinds.qwen2_vl.verify import hf_vlm_forward
    from megappo.testing.vlm_models import image_batch, make_hf_vlm

    hf_dir = make_hf_vlm(str(tmp_path / family), family)
    batch = image_batch(hf_dir)
    mcore_dir = str(tmp_path / "mcore") if via_commands else None
    outs = run_distributed(_job, 4, hf_dir, mcore_dir, batch, 2, 2, timeout=400)
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
    if via_commands:
        from megappo.kinds.commands import mcore_to_hf

        mcore_to_hf(mcore_dir, str(tmp_path / "hf_out"), progress=False)
        written = {}
        for f in (tmp_path / "hf_out").glob("*.safetensors"):
            written.update(load_file(str(f)))
        assert set(written) == set(saved)
        assert all(torch.equal(written[k], saved[k]) for k in saved), "streamed mcore-to-hf is not bit-exact"


@pytest.mark.parametrize("family", ["qwen2_5_vl", pytest.param("qwen2_vl", marks=pytest.mark.long)])
def test_vlm_tp2_pp2_matches_transformers(tmp_path, family):
    _check(tmp_path, family, via_commands=False)


@pytest.mark.long
def test_vlm_tp2_pp2_conversion_commands(tmp_path):
    _check(tmp_path, "qwen2_5_vl", via_commands=True)
