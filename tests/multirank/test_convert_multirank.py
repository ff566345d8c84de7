"""Conversion at TP2 x PP2 (dense, tied embeddings; PP2 x VPP2) and TP2 x PP2 x EP2, TP2 x EP2 x ETP2 (MoE) on 4
gloo ranks.

One spawned job runs every multi-rank check (each process import costs ~10 s on the CI machine); the MoE checkpoint
it writes is then loaded at TP1 in this process.
"""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.multirank, pytest.mark.slow]


def _check_export_matches(chunks, ps, hf_dir) -> int:
    """iter_hf_weights on this rank == the HF files, bit for bit; returns the tensor count."""
    from safetensors.torch import load_file

    from megappo.convert.hf_io import HFCheckpoint
    from megappo.kinds.weights import hf_state_dict

    ckpt = HFCheckpoint.open(hf_dir)
    ours = hf_state_dict(chunks, ps, ckpt.config, bucket_bytes=64 << 10)
    ref = load_file(os.path.join(hf_dir, "model.safetensors"))
    assert sorted(ours) == sorted(ref), set(ours) ^ set(ref)
    bad = [k for k in ref if not torch.equal(ours[k], ref[k])]
    assert not bad, f"rank {ps.rank}: differ {bad[:5]}"
    return len(ours)


def _job(rank, world_size, dense_dir, moe_dir, work):
    from megappo.kinds.build import build_for_conversion
    from megappo.kinds.commands import hf_to_mcore, verify
    from megappo.kinds.weights import load_hf_weights
    from megappo.parallel import init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout

    out = {}
    # dense, tied embeddings: convert at TP2xPP2, verify there, export is bit-identical on every rank
    dense_ckpt = os.path.join(work, "dense_tp2pp2")
    hf_to_mcore(dense_dir, dense_ckpt, tp=2, pp=2, progress=False, bucket_bytes=64 << 10)
    out["dense_verify"] = verify(dense_dir, dense_ckpt, tp=2, pp=2)["max_abs_diff"]
    platform = detect_platform(dtype="float32")
    ps = init_parallel(ParallelLayout(tp=2, pp=2), platform)
    chunks = build_for_conversion(dense_dir, "actor", ps, platform)
    load_hf_weights(chunks, dense_dir, ps)
    out["dense_export"] = _check_export_matches(chunks, ps, dense_dir)
    # interleaved pipeline: PP2 x VPP2 (2 data-parallel replicas)
    ps = init_parallel(ParallelLayout(pp=2, vpp=2), platform)
    chunks = build_for_conversion(dense_dir, "actor", ps, platform)
    load_hf_weights(chunks, dense_dir, ps)
    out["vpp_export"] = _check_export_matches(chunks, ps, dense_dir)
    out["vpp_verify"] = verify(dense_dir, dense_ckpt, pp=2, vpp=2)["max_abs_diff"]
    # MoE: TP2 x PP2 x EP2 (expert TP 1), written for the TP1 load in the parent
    moe_ckpt = os.path.join(work, "moe_tp2pp2ep2")
    hf_to_mcore(moe_dir, moe_ckpt, tp=2, pp=2, ep=2, etp=1, progress=False, bucket_bytes=96 << 10)
    out["moe_verify"] = verify(moe_dir, moe_ckpt, tp=2, pp=2, ep=2, etp=1)["max_abs_diff"]
    # and at TP2 x EP2 from the TP2xPP2xEP2 files (a reshard)
    out["moe_reshard_verify"] = verify(moe_dir, moe_ckpt, tp=2, ep=2, etp=1)["max_abs_diff"]
    ps = init_parallel(ParallelLayout(tp=2, pp=2, ep=2, etp=1), platform)
    chunks = build_for_conversion(moe_dir, "actor", ps, platform)
    load_hf_weights(chunks, moe_dir, ps)
    out["moe_export"] = _check_export_matches(chunks, ps, moe_dir)
    # experts split over expert-TP ranks too: TP2 x EP2 x ETP2 (2 data-parallel replicas of the dense part)
    ps = init_parallel(ParallelLayout(tp=2, ep=2, etp=2), platform)
    chunks = build_for_conversion(moe_dir, "actor", ps, platform)
    load_hf_weights(chunks, moe_dir, ps)
    out["moe_etp_export"] = _check_export_matches(chunks, ps, moe_dir)
    return out


def test_convert_tp2_pp2_ep2(hf_model_dir, tmp_path):
    from megappo.testing.dist import run_distributed

    dense, moe = hf_model_dir("qwen2_tied"), hf_model_dir("qwen2_moe")
    results = run_distributed(_job, 4, dense, moe, str(tmp_path), timeout=400)
    for r in results:
        assert r["dense_verify"] < 1e-4 and r["vpp_verify"] < 1e-4 and r["moe_verify"] < 1e-4, r
        assert r["moe_reshard_verify"] < 1e-4, r
        assert r["dense_export"] == r["vpp_export"] > 0 and r["moe_export"] == r["moe_etp_export"] > 0, r
    # the TP2xPP2xEP2 checkpoint loads at TP1 in this (single) process with the same outputs as HF
    from megappo.kinds.commands import verify

    assert verify(moe, str(tmp_path / "moe_tp2pp2ep2"))["max_abs_diff"] < 1e-4
