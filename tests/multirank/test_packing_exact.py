"""Sequence packing (`MicroBatching(packed=True)`, verl's use_remove_padding) equals the padded path.

Each layout runs, on the same weights and the same batch (rows whose lengths differ by more than 10x), the padded
and the packed path: log-probs, entropy, sum p^2, values, the actor's and the critic's step loss and metrics, and every
gradient (megatron DDP's main_grad, this rank's shard) must agree to 1e-5 (max |a - b| / max |b|, fp32).
World 1 (TP1, fixed and dynamic micro-batches) runs in the default test run; DP2, TP2 x PP2, PP2 x VPP2 and EP2
(MoE) are `long` (a spawned gloo job each, ~1 min).
"""
from __future__ import annotations

import pytest
import torch

from megappo.testing.dist import run_distributed

pytestmark = pytest.mark.multirank

REL = 1e-5


def _batch():
    from megappo.testing.batches import random_batch

    rlens = [3, 60, 5, 41, 2, 17, 33, 6]  # totals 5 .. 67: more than 10x apart
    return random_batch(11, [2, 7, 3, 5, 4, 6, 2, 3], rlens, old_log_prob=-6.0, values=True)


def _job(rank, world_size, hf_dir, layouts):
    import io

    out = [_run_layout(layout, hf_dir, micro_kw) for layout, micro_kw in layouts]
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


def _run_layout(layout_kw, hf_dir, micro_kw):
    from megappo.models.compute import MicroBatching, compute_log_probs, compute_values, train_step
    from megappo.testing.layout_roles import layout_roles

    res: dict = {}
    for r in layout_roles(layout_kw, hf_dir, _batch()):
        # megappo's padded path does not pad [b, s] to a multiple of TP for sequence parallelism: packed only
        for packed in ((True,) if layout_kw.get("sequence_parallel") else (False, True)):
            micro = MicroBatching(**micro_kw, packed=packed)
            key = f"{r.role}_{'packed' if packed else 'padded'}"
            if r.role == "actor":
                res[key + "_logp"], res[key + "_ent"], res[key + "_sq"] = compute_log_probs(
                    r.ddp, r.batch, parallel_state=r.ps, micro=micro, calculate_entropy=True,
                    calculate_sum_pi_squared=True)
            else:
                res[key + "_values"] = compute_values(r.ddp, r.batch, parallel_state=r.ps, micro=micro)
            m = train_step(r.ddp, r.optimizer, None, r.batch, r.loss_fn, parallel_state=r.ps, micro=micro,
                           calculate_entropy=r.role == "actor", platform=r.platform)
            res[key + "_metrics"] = {"loss": m.loss, "grad_norm": m.grad_norm, **m.metrics}
            res[key + "_grads"] = [p.main_grad.detach().clone() for c in r.ddp for p in c.parameters()]
    return res


def _close(a, b, what):
    err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)
    assert err <= REL, f"{what}: relative error {err:.2e} > {REL}"


def _check(res, name, padded=None):
    """res's packed results against its padded ones (or `padded`'s, a layout with the same shards)."""
    padded = padded or res
    for role, outs in (("actor", ("logp", "ent", "sq")), ("critic", ("values",))):
        for o in outs:
            _close(res[f"{role}_packed_{o}"], padded[f"{role}_padded_{o}"], f"{name} {role} {o}")
        mp, mq = padded[f"{role}_padded_metrics"], res[f"{role}_packed_metrics"]
        assert mp.keys() == mq.keys()
        for k in mp:
            assert abs(mq[k] - mp[k]) <= REL * max(abs(mp[k]), 1e-6), (name, role, k, mq[k], mp[k])
        assert mp["grad_norm"] > 0
        for i, (g, gp) in enumerate(zip(res[f"{role}_packed_grads"], padded[f"{role}_padded_grads"], strict=True)):
            _close(g, gp, f"{name} {role} grad {i}")


def _spawn(world, hf_dir, layouts, timeout=400):
    import io

    raw = run_distributed(_job, world, hf_dir, layouts, timeout=timeout)
    return [torch.load(io.BytesIO(b), weights_only=False) for b in raw]


def test_packed_equals_padded_tp1(hf_model_dir):
    """World 1: fixed micro-batches of 3 (a micro-batch is one pack), a token budget (budget fills packs), and
    full activation recompute (gradient checkpointing: the packed params reach the recomputed layers)."""
    hf_dir = hf_model_dir("qwen2")
    layouts = [({}, {"micro_batch_size": 3}), ({}, {"use_dynamic_bsz": True, "max_token_len": 80}),
               ({"recompute": True}, {"micro_batch_size": 4})]
    (per_layout,) = _spawn(1, hf_dir, layouts, timeout=300)
    for (layout, micro), res in zip(layouts, per_layout):
        _check(res, f"tp1 {micro}")


@pytest.mark.long
def test_packed_equals_padded_dp2_tp2_sp_pp2_vpp2(hf_model_dir):
    hf_dir = hf_model_dir("qwen2")
    dyn = {"use_dynamic_bsz": True, "max_token_len": 80}
    layouts = [({}, dyn), ({"tp": 2}, dyn), ({"tp": 2, "sequence_parallel": True}, dyn),
               ({"pp": 2}, {"micro_batch_size": 2}), ({"pp": 2, "vpp": 2}, dyn)]
    per_rank = _spawn(2, hf_dir, layouts)
    for r in range(2):
        for (layout, micro), res in zip(layouts, per_rank[r]):
            # TP2 with sequence parallelism (packs padded to a multiple of 2) against TP2's padded path
            _check(res, f"rank {r} {layout} {micro}", per_rank[r][1] if layout.get("sequence_parallel") else None)


@pytest.mark.long
def test_packed_equals_padded_tp2xpp2(hf_model_dir):
    hf_dir = hf_model_dir("qwen2")
    layouts = [({"tp": 2, "pp": 2}, {"use_dynamic_bsz": True, "max_token_len": 80})]
    for r, res in enumerate(_spawn(4, hf_dir, layouts)):
        _check(res[0], f"rank {r} tp2 pp2")


@pytest.mark.long
def test_packed_equals_padded_moe_ep2(hf_model_dir):
    hf_dir = hf_model_dir("qwen3_moe")
    layouts = [({"ep": 2}, {"use_dynamic_bsz": True, "max_token_len": 80})]
    for r, res in enumerate(_spawn(2, hf_dir, layouts)):
        _check(res[0], f"rank {r} ep2")
