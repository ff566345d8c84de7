"""Qwen2.5-VL / Qwen2-VL on megatron-core at TP1 against transformers, on real image inputs of different sizes.

One process (a world of one, fresh for megatron's global state): the tiny random HF model is loaded through
`load_hf_weights` (the VLM hook), run on three images of different sizes (4x6, 8x4 and 10x8 patches: partial
windows, several windows, full-attention blocks) and compared with `Qwen2_5_VLForConditionalGeneration` on the real
tokens; the mrope positions equal transformers' `get_rope_index`; the export (`hf_state_dict`) reproduces the
checkpoint bit for bit; `convert hf-to-mcore` + `verify` (images through both models) pass. The critic gets a value
head and the vision tower is frozen by default.
"""
from __future__ import annotations

import pytest
import torch

from megappo.testing.dist import run_distributed



def _job(rank, world_size, hf_dir, mcore_dir, batch):
    from megappo.convert.hf_io import read_json_object
    from megappo.kinds.build import build_model
    from megappo.kinds.qwen2_vl.verify import vlm_mcore_forward
    from megappo.kinds.weights import hf_state_dict, load_hf_weights
    from megappo.parallel import destroy_parallel, init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout

    plat = detect_platform()
    ps = init_parallel(ParallelLayout(), plat, seed=0)
    actor = build_model(hf_dir, "actor", ps, plat)
    load_hf_weights(actor, hf_dir, ps)
    logits = vlm_mcore_forward(actor, ps, batch, vocab_size=512)
    positions = actor[0].mrope_positions(batch["input_ids"], batch["image_grid_thw"], batch["attention_mask"])
    exported = hf_state_dict(actor, ps, read_json_object(f"{hf_dir}/config.json", "config"))
    trainable = {n for n, p in actor[0].named_parameters() if p.requires_grad}
    unfrozen = build_model(hf_dir, "actor", ps, plat, freeze_vision_tower=False)
    grads = {}
    for name, chunks in (("frozen", actor), ("unfrozen", unfrozen)):  # backward reaches what trains, only that
        m = chunks[0].train()
        m(batch["input_ids"], None, None, batch["pixel_values"], batch["image_grid_thw"],
          token_mask=batch["attention_mask"]).float().pow(2).mean().backward()
        grads[name] = {n: p.grad is not None and bool(p.grad.abs().sum() > 0) for n, p in m.named_parameters()}
    critic = build_model(hf_dir, "critic", ps, plat)
    load_hf_weights(critic, hf_dir, ps)
    values = vlm_mcore_forward(critic, ps, batch)
    # the conversion commands: streaming hf-to-mcore into a dist_checkpoint, then verify runs images through both
    from megappo.kinds.commands import hf_to_mcore, verify

    hf_to_mcore(hf_dir, mcore_dir, progress=False)
    verified = verify(hf_dir, mcore_dir)
    destroy_parallel()
    return {"logits": logits, "positions": positions, "exported": exported, "trainable": trainable,
            "unfrozen_vision_trainable": all(p.requires_grad for p in unfrozen[0].vision_model.parameters()),
            "values": values, "value_head": tuple(critic[0].language_model.output_layer.weight.shape),
            "verified": verified, "grads": grads}


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
def test_vlm_matches_transformers_with_images(tmp_path, family):
    from safetensors.torch import load_file

    from megappo.kinds.qwen2_vl.verify import hf_vlm_forward
    from megappo.testing.vlm_models import IMAGE_TOKEN, image_batch, make_hf_vlm

    hf_dir = make_hf_vlm(str(tmp_path / family), family)
    batch = image_batch(hf_dir)
    assert sorted(map(tuple, batch["image_grid_thw"].tolist())) == [(1, 4, 6), (1, 8, 4), (1, 10, 8)]
    (out,) = run_distributed(_job, 1, hf_dir, str(tmp_path / "mcore"), batch, timeout=300)

    ref = hf_vlm_forward(hf_dir, batch)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(out["logits"][real], ref[real], rtol=0, atol=1e-4)

    import transformers

    cls = (transformers.Qwen2_5_VLForConditionalGeneration if family == "qwen2_5_vl"
           else transformers.Qwen2VLForConditionalGeneration)
    hf = cls.from_pretrained(hf_dir)
    ref_pos, _ = hf.model.get_rope_index(batch["input_ids"], (batch["input_ids"] == IMAGE_TOKEN).int(),
                                         batch["image_grid_thw"], attention_mask=batch["attention_mask"])
    assert torch.equal(out["positions"][:, real], ref_pos[:, real])

    saved = load_file(f"{hf_dir}/model.safetensors")
    assert set(out["exported"]) == set(saved)
    assert all(torch.equal(out["exported"][k], saved[k]) for k in saved), "export is not bit-exact"

    # freeze_vision_tower (default on): nothing under vision_model trains, the whole language model does
    assert out["trainable"] and not any(n.startswith("vision_model.") for n in out["trainable"])
    assert out["unfrozen_vision_trainable"]
    for name, has_grad in out["grads"]["frozen"].items():
        assert has_grad != name.startswith("vision_model."), name
    assert all(out["grads"]["unfrozen"].values()), [n for n, g in out["grads"]["unfrozen"].items() if not g]
    assert out["value_head"] == (1, 64)
    assert out["values"].shape == batch["input_ids"].shape and torch.isfinite(out["values"]).all()
    assert out["verified"]["ok"] and out["verified"]["max_abs_diff"] < 1e-4, out["verified"]
    assert len(out["verified"]["images"]) == 3
