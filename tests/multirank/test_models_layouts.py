"""Every parallel layout gives the single-rank outputs (fp32, 1e-5 relative), and checkpoints cross layouts.

One reference job (world 1) builds each family with a seed, saves a dist checkpoint and records logits (critic:
values). A 4-rank job loads those checkpoints at TP2xPP2 (and saves them again there) and at PP2xEP2 (alltoall
dispatcher); a 2-rank job loads them at TP2, PP2, PP2xVPP2, EP2, TP2 with sequence parallel, TP2xEP2 with expert
TP 1, and loads the TP2xPP2 checkpoints at TP1. Layouts are batched into one spawned job per world size because each
process pays ~10 s of imports.
"""
from __future__ import annotations

import os
import time

import pytest

pytestmark = pytest.mark.multirank

DENSE = ["llama", "qwen2_tied", "qwen3"]
MOE = ["qwen2_moe", "qwen3_moe", "mixtral"]
# (family, role) pairs checked at every layout; the critic checks the value head (and untying) under TP/PP.
CASES = [(f, "actor") for f in DENSE + MOE] + [("qwen2_tied", "critic")]
BATCH, SEQ, MICRO = 4, 12, 2  # 2 micro-batches of 2 sequences


def _inputs():
    import torch

    g = torch.Generator().manual_seed(123)
    ids = torch.randint(0, 500, (BATCH, SEQ), generator=g)
    pos = torch.arange(SEQ).expand(BATCH, SEQ).contiguous()
    return ids, pos


def _forward(model_chunks, parallel_state):
    """Forward-only through megatron's schedule; full logits/values [B, T, ...] on the last stage, else None."""
    import torch
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ids, pos = _inputs()
    batches = [(ids[i:i + MICRO], pos[i:i + MICRO]) for i in range(0, BATCH, MICRO)]

    def step(data_iterator, model):
        mb_ids, mb_pos = next(data_iterator)
        out = model(mb_ids, mb_pos, None)
        return out, lambda t, non_loss_data=False: t.detach()

    for chunk in model_chunks:
        chunk.eval()  # megatron refuses MoE x TP in training mode without sequence parallel
    iters = [iter(list(batches)) for _ in model_chunks]
    fb = get_forward_backward_func()
    with torch.no_grad():
        outs = fb(
            forward_step_func=step, data_iterator=iters if len(iters) > 1 else iters[0], model=model_chunks,
            num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=MICRO, forward_only=True,
            collect_non_loss_data=True,
        )
    if not parallel_state.is_pipeline_last_stage:
        return None
    out = torch.cat(outs, dim=0)
    if out.dim() == 3 and parallel_state.tp_size > 1:  # vocab-parallel logits: gather for the comparison only
        parts = [torch.empty_like(out) for _ in range(parallel_state.tp_size)]
        dist.all_gather(parts, out.contiguous(), group=parallel_state.tp_group)
        out = torch.cat(parts, dim=-1)
    return out


def _setup(layout_kw):
    from megappo.platform.layout import ParallelLayout
    from megappo.parallel import init_parallel
    from megappo.platform import detect_platform

    platform = detect_platform()
    return platform, init_parallel(ParallelLayout(**layout_kw), platform, seed=0)


def _reference_job(rank, world_size, hf_dirs, ckpt_root):
    """World 1: build, save, record outputs. Returns {(family, role): output} and timings."""
    import torch

    from megappo.kinds.build import build_model
    from megappo.models.builder import offload_to_cpu, reload, unwrap
    from megappo.models.checkpoint import save_model_checkpoint
    from megappo.models.value_head import last_token_values
    from megappo.parallel import destroy_parallel

    t0 = time.perf_counter()
    platform, ps = _setup({})
    outputs, times = {}, {"setup_s": time.perf_counter() - t0}
    for family, role in CASES:
        t = time.perf_counter()
        chunks = build_model(hf_dirs[family], role, ps, platform, seed=7)
        times[f"build_{family}_{role}_s"] = time.perf_counter() - t
        outputs[(family, role)] = _forward(chunks, ps).numpy()
        if role == "critic":
            assert outputs[(family, role)].shape == (BATCH, SEQ)  # one value per token
        save_model_checkpoint(chunks, os.path.join(ckpt_root, f"ref_{family}_{role}"))
    # The reward role: the critic's head read at each row's last token (right padding here).
    reward = build_model(hf_dirs["qwen2_tied"], "reward", ps, platform, seed=7)
    values = _forward(reward, ps)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, 5:] = 0
    scores = last_token_values(values, mask)
    assert scores.shape == (BATCH,) and scores[0] == values[0, 4] and scores[1] == values[1, -1]
    assert unwrap(reward[0]).output_layer.weight.shape == (1, 64)
    # The reference role is frozen; offload/reload are no-ops on CPU.
    ref = build_model(hf_dirs["llama"], "ref", ps, platform, seed=7)
    assert not ref[0].training and not any(p.requires_grad for p in ref[0].parameters())
    offload_to_cpu(ref)
    reload(ref, platform.device)
    assert abs(_forward(ref, ps).numpy() - outputs[("llama", "actor")]).max() == 0
    destroy_parallel()
    return outputs, times


def _layouts_job(rank, world_size, hf_dirs, ckpt_root, layouts):
    """For each (name, layout, cases, load_tag, save_tag): load the `load_tag` checkpoints at that layout (and save
    them again under `save_tag` when set); return outputs per (layout name, family, role) and seconds per layout."""
    from megappo.kinds.build import build_model
    from megappo.models.checkpoint import load_model_checkpoint, save_model_checkpoint
    from megappo.parallel import destroy_parallel

    results, times = {}, {}
    for name, layout_kw, cases, load_tag, save_tag in layouts:
        t = time.perf_counter()
        platform, ps = _setup(layout_kw)
        assert ps.tp_size * ps.pp_size * ps.cp_size * ps.dp_size == world_size, ps.describe()
        assert (ps.tp_size, ps.pp_size, ps.ep_size) == (layout_kw.get("tp", 1), layout_kw.get("pp", 1),
                                                        layout_kw.get("ep", 1)), ps.describe()
        for family, role in cases:
            # megatron trains MoE x TP only with sequence parallel (GPU): check those forward passes as the frozen
            # reference model, which loads the same actor checkpoint.
            sp = layout_kw.get("sequence_parallel", False)
            build_role = "ref" if family in MOE and ps.tp_size > 1 and role == "actor" and not sp else role
            # A different seed than the reference: only the checkpoint can make the outputs agree.
            chunks = build_model(hf_dirs[family], build_role, ps, platform, seed=99)
            load_model_checkpoint(chunks, os.path.join(ckpt_root, f"{load_tag}_{family}_{role}"))
            out = _forward(chunks, ps)
            if out is not None and ps.tp_rank == 0 and ps.dp_rank == 0:
                results[(name, family, role)] = out.numpy()
            if save_tag:
                save_model_checkpoint(chunks, os.path.join(ckpt_root, f"{save_tag}_{family}_{role}"))
        destroy_parallel()
        times[name] = time.perf_counter() - t
    return results, times


def _assert_close(got, want, what):
    err = abs(got - want).max() / max(abs(want).max(), 1e-12)
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    assert err <= 1e-5, f"{what}: max relative difference {err:.2e} > 1e-5"


@pytest.fixture(scope="module")
def hf_dirs(hf_model_dir):
    return {f: hf_model_dir(f) for f in DENSE + MOE}


@pytest.fixture(scope="module")
def reference(hf_dirs, tmp_path_factory):
    from megappo.testing.dist import run_distributed

    root = str(tmp_path_factory.mktemp("layout_ckpts"))
    outputs, times = run_distributed(_reference_job, 1, hf_dirs, root)[0]
    print("reference job timings:", {k: round(v, 2) for k, v in times.items()})
    return root, outputs


@pytest.fixture(scope="module")
def tp2pp2_results(hf_dirs, reference):
    from megappo.testing.dist import run_distributed

    root, _ = reference
    layouts = [
        ("tp2pp2", dict(tp=2, pp=2), CASES, "ref", "tp2pp2"),
        # the alltoall dispatcher (pipeline parallel turns on variable sequence lengths) across 2 expert ranks
        ("pp2ep2", dict(pp=2, ep=2), [(f, "actor") for f in MOE], "ref", None),
    ]
    t = time.perf_counter()
    per_rank = run_distributed(_layouts_job, 4, hf_dirs, root, layouts)
    print(f"4-rank job {time.perf_counter() - t:.1f}s, per layout:", per_rank[0][1])
    return {k: v for res, _ in per_rank for k, v in res.items()}


def test_four_rank_layouts_match_single_rank(reference, tp2pp2_results):
    _, ref = reference
    for family, role in CASES:
        _assert_close(tp2pp2_results[("tp2pp2", family, role)], ref[(family, role)], f"TP2xPP2 {family} {role}")
    for family in MOE:
        _assert_close(tp2pp2_results[("pp2ep2", family, "actor")], ref[(family, "actor")], f"PP2xEP2 {family}")


def test_two_rank_layouts_match_single_rank_and_load_tp2pp2_checkpoint(hf_dirs, reference, tp2pp2_results):
    from megappo.testing.dist import run_distributed

    root, ref = reference
    layouts = [
        ("tp2", dict(tp=2), CASES, "ref"),
        ("pp2", dict(pp=2), CASES, "ref"),
        ("pp2vpp2", dict(pp=2, vpp=2), [("qwen2_tied", "actor"), ("qwen2_moe", "actor")], "ref"),
        ("ep2", dict(ep=2), [(f, "actor") for f in MOE], "ref"),
        # sequence parallel: megappo's SP-capable norm in the local spec; the critic's head gathers the sequence
        ("tp2sp", dict(tp=2, sequence_parallel=True),
         [("qwen3", "actor"), ("qwen2_moe", "actor"), ("qwen2_tied", "critic")], "ref"),
        # experts split over 2 ranks and not tensor-parallel, attention tensor-parallel over the same 2 ranks
        ("tp2ep2etp1", dict(tp=2, ep=2, etp=1, sequence_parallel=True), [("qwen3_moe", "actor"), ("mixtral", "actor")],
         "ref"),
        # The TP2xPP2 checkpoint loaded at TP1 (DP2) gives the outputs of the TP2xPP2 model that saved it.
        ("tp1", {}, CASES, "tp2pp2"),
    ]
    t = time.perf_counter()
    per_rank = run_distributed(_layouts_job, 2, hf_dirs, root, [(*entry, None) for entry in layouts])
    print(f"2-rank job {time.perf_counter() - t:.1f}s, per layout:", per_rank[0][1])
    got = {k: v for res, _ in per_rank for k, v in res.items()}
    for name, _, cases, _ in layouts[:-1]:
        for family, role in cases:
            _assert_close(got[(name, family, role)], ref[(family, role)], f"{name} {family} {role}")
    for family, role in CASES:
        _assert_close(got[("tp1", family, role)], tp2pp2_results[("tp2pp2", family, role)],
                      f"TP2xPP2 checkpoint at TP1 {family} {role}")
        _assert_close(got[("tp1", family, role)], ref[(family, role)], f"TP2xPP2 checkpoint at TP1 vs ref {family}")
