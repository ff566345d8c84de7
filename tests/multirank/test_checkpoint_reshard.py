"""Weights and Adam state saved at TP2xPP2 (4 ranks, distributed optimizer; and, `long`, at CP2 on 2 ranks) resume
at TP1 (1 rank): the next step after loading equals the step the saving run took after saving. The same checkpoint
loads weights alone, and a model needing tensors it lacks is refused.

This is the resume path of a run whose layout changes between jobs (fewer or other GPUs); megappo saves optimizer
state in megatron's fully reshardable form for it. Compared under Hugging Face names (TP and PP merged).
"""
from __future__ import annotations

import pytest
import torch

from megappo.testing.dist import run_distributed

pytestmark = pytest.mark.multirank


def _batch():
    from megappo.testing.batches import random_batch

    return random_batch(5, (3, 6, 2, 5), (4, 2, 6, 3))


def _loss(out, ctx):
    m = ctx.batch.response_mask.float()
    return -(out.log_probs * m).sum() / ctx.global_num_tokens, {}


def _setup(hf_dir, layout_kw):
    from megappo.kinds.build import build_model
    from megappo.kinds.weights import load_hf_weights
    from megappo.models.optim import OptimSettings, build_optimizer, build_scheduler, wrap_ddp
    from megappo.parallel import init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout

    plat = detect_platform()
    ps = init_parallel(ParallelLayout(**layout_kw), plat, seed=0)
    chunks = build_model(hf_dir, "actor", ps, plat, seed=0)
    load_hf_weights(chunks, hf_dir, ps)
    # eps 1e-3: see test_compute (Adam's first steps amplify layout-dependent float noise of near-zero gradients)
    settings = OptimSettings(lr=1e-2, eps=1e-3, clip_grad=1.0, total_steps=4, use_distributed_optimizer=True)
    model = wrap_ddp(chunks, settings, plat)
    opt = build_optimizer(model, settings, plat)
    return plat, ps, model, opt, build_scheduler(opt, settings)


def _step(plat, ps, model, opt, sched):
    from megappo.models.compute import MicroBatching, train_step

    return train_step(model, opt, sched, _batch(), _loss, parallel_state=ps, platform=plat,
                      micro=MicroBatching(micro_batch_size=2)).grad_norm


def _weights(model, ps, hf_dir):
    from megappo.kinds.weights import hf_state_dict
    from megappo.models.hf_config import load_hf_config_dict

    return {k: v.clone() for k, v in hf_state_dict(model, ps, load_hf_config_dict(hf_dir)).items()}


def _save_then_step(rank, world_size, hf_dir, ckpt, layout_kw):
    from megappo.models.checkpoint import save_model_checkpoint
    from megappo.parallel import destroy_parallel

    plat, ps, model, opt, sched = _setup(hf_dir, layout_kw)
    _step(plat, ps, model, opt, sched)
    save_model_checkpoint(model, ckpt, optimizer=opt, scheduler_state=sched.state_dict(), dp_cp_group=ps.dp_cp_group)
    saved = _weights(model, ps, hf_dir)  # collective: TP and PP gathered
    norm = _step(plat, ps, model, opt, sched)
    weights = _weights(model, ps, hf_dir)
    out = (norm, weights, saved) if rank == 0 else None
    destroy_parallel()
    return out


def _load_then_step(rank, world_size, hf_dir, ckpt, qk_norm_dir, layout_kw):
    from megappo.kinds.build import build_model
    from megappo.models.checkpoint import CheckpointError, load_model_checkpoint
    from megappo.parallel import destroy_parallel

    plat, ps, model, opt, sched = _setup(hf_dir, {})
    # the weights alone load from a checkpoint that also holds optimizer state (e.g. a reference model from a run)
    ref = build_model(hf_dir, "ref", ps, plat, seed=1)
    load_model_checkpoint(ref, ckpt)
    # a model that needs tensors the checkpoint lacks (Qwen3's QK norms) is refused, naming them
    try:
        load_model_checkpoint(build_model(qk_norm_dir, "actor", ps, plat), ckpt)
        refused = None
    except CheckpointError as e:
        refused = str(e)
    loaded = load_model_checkpoint(model, ckpt, optimizer=opt, dp_cp_group=ps.dp_cp_group)
    sched.load_state_dict(loaded.scheduler_state)
    assert all(loaded.info["layout"][k] == v for k, v in layout_kw.items()), loaded.info["layout"]
    norm = _step(plat, ps, model, opt, sched)
    out = (norm, _weights(model, ps, hf_dir), _weights(ref, ps, hf_dir), refused)
    destroy_parallel()
    return out


@pytest.mark.parametrize("world,layout_kw", [
    (4, {"tp": 2, "pp": 2}),
    # context parallelism: the CP ranks' identical weights, Adam state sharded over data x context parallel ranks
    pytest.param(2, {"cp": 2}, marks=pytest.mark.long),
], ids=["tp2xpp2", "cp2"])
def test_adam_state_saved_at_tp2xpp2_or_cp2_resumes_at_tp1(hf_model_dir, tmp_path, world, layout_kw):
    hf_dir = hf_model_dir("qwen2")
    ckpt = str(tmp_path / "ckpt")
    want_norm, want, saved = run_distributed(_save_then_step, world, hf_dir, ckpt, layout_kw, timeout=400)[0]
    got_norm, got, ref, refused = run_distributed(_load_then_step, 1, hf_dir, ckpt, hf_model_dir("qwen3"),
                                                  layout_kw, timeout=300)[0]
    assert all(torch.equal(ref[k], saved[k]) for k in saved), "weights-only load differs from the saved weights"
    assert refused is not None and "needs" in refused and "layernorm" in refused, refused
    assert got_norm == pytest.approx(want_norm, rel=1e-5)
    assert set(got) == set(want)
    for k in want:
        err = (got[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-12)
        assert err < 1e-4, f"{k}: relative difference {err:.2e} after resuming at TP1"
