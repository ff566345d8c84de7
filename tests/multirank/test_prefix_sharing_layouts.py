"""Prefix sharing (`MicroBatching(share_prefix=True)`) equals the unshared packed path in every layout.

Each layout runs, on the same weights and the same batch (GRPO-like groups of 4, 3 and 2 rows of one prompt,
interleaved with rows alone, responses 1 to 37 tokens and one empty), the packed path and the shared one:
log-probs, entropy, values, the actor's and the critic's step loss and metrics, and every gradient (megatron DDP's
main_grad) must agree to 1e-5 (max |a - b| / max |b|, fp32). World 1 (fixed and dynamic micro-batches, full
recompute, the padded path as a third witness, top-k log-probs) runs in the default test run;
CP2 (one tree row per group, `prefix_cp`) too, ~17 s; TP2, TP2 with sequence parallelism, PP2, PP2 x VPP2, DP2,
EP2 x TP2 and CP2 x EP2 (Qwen3-MoE), CP2 against one rank, CP2 x TP2 with sequence parallelism, CP2 x PP2 (x VPP2) are `long` here (a
spawned gloo job each, ~20-35 s).
"""
from __future__ import annotations

import pytest
import torch

from megappo.testing.dist import run_distributed

pytestmark = pytest.mark.multirank

REL = 1e-5
ROWS = [0, 1, 0, 2, 3, 0, 1, 4, 0, 3, 1, 5]  # the prompt of each row: prompt 0 x4, 1 x3, 3 x2, 2, 4, 5 alone


def batch():
    from megappo.testing.batches import grouped_batch

    return grouped_batch(5, ROWS, [19, 6, 4, 9, 1, 13], [5, 12, 1, 37, 3, 9, 0, 2, 8, 4, 30, 6],
                         old_log_prob=-6.0, values=True)


def job(rank, world_size, hf_dir, layouts):
    import io

    out = [_run_layout(layout, hf_dir, micro_kw, modes) for layout, micro_kw, modes in layouts]
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


def _run_layout(layout_kw, hf_dir, micro_kw, modes):
    """modes: (name, MicroBatching kwargs) to run; each gets log-probs, values, a step's metrics and grads."""
    from megappo.models.compute import (
        MicroBatching, compute_log_probs, compute_topk_log_probs, compute_values, train_step,
    )
    from megappo.models.layout.plan import plan_micro_batches
    from megappo.testing.layout_roles import layout_roles

    res: dict = {}
    for r in layout_roles(layout_kw, hf_dir, batch()):
        ddp, batch_, ps = r.ddp, r.batch, r.ps
        for name, kw in modes:
            micro = MicroBatching(**micro_kw, **kw)
            key = f"{r.role}_{name}"
            try:
                if r.role == "actor":
                    res[key + "_logp"], res[key + "_ent"] = compute_log_probs(
                        ddp, batch_, parallel_state=ps, micro=micro, calculate_entropy=True)
                    if ps.world_size == 1:  # a distillation teacher's top-k tokens read back the same
                        _, res[key + "_topk"], ids = compute_topk_log_probs(ddp, batch_, 3, parallel_state=ps,
                                                                            micro=micro)
                        res[key + "_topk_ids"] = ids.float()
                else:
                    res[key + "_values"] = compute_values(ddp, batch_, parallel_state=ps, micro=micro)
            except ValueError as e:  # a layout that refuses sharing
                res[key + "_error"] = str(e)
                continue
            plan = plan_micro_batches(ddp, batch_, micro, ps)
            res[key + "_packs"] = [type(getattr(lay, "pack", None)).__name__ for lay in plan.layouts]
            res[key + "_rows"] = [type(getattr(lay, "layout_rows", None)).__name__ for lay in plan.layouts]
            m = train_step(ddp, r.optimizer, None, batch_, r.loss_fn, parallel_state=ps, micro=micro,
                           calculate_entropy=r.role == "actor", platform=r.platform)
            res[key + "_metrics"] = {"loss": m.loss, "grad_norm": m.grad_norm, **m.metrics}
            res[key + "_grads"] = [p.main_grad.detach().clone() for c in ddp for p in c.parameters()]
    return res


def close(a, b, what):
    err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)
    assert err <= REL, f"{what}: relative error {err:.2e} > {REL}"


def check(res, name, got="shared", want="packed"):
    """res's `got` results against its `want` ones: outputs, step metrics, every gradient."""
    for role, outs in (("actor", ("logp", "ent")), ("critic", ("values",))):
        for o in outs:
            close(res[f"{role}_{got}_{o}"], res[f"{role}_{want}_{o}"], f"{name} {role} {o}")
        mp, mq = res[f"{role}_{want}_metrics"], res[f"{role}_{got}_metrics"]
        assert mp.keys() == mq.keys()
        for k in mp:
            assert abs(mq[k] - mp[k]) <= REL * max(abs(mp[k]), 1e-6), (name, role, k, mq[k], mp[k])
        assert mp["grad_norm"] > 0
        for i, (g, gp) in enumerate(zip(res[f"{role}_{got}_grads"], res[f"{role}_{want}_grads"], strict=True)):
            close(g, gp, f"{name} {role} grad {i}")


PACKED_SHARED = (("packed", {"packed": True, "share_prefix": False}),
                 ("shared", {"packed": True, "share_prefix": True}))


def spawn(world, hf_dir, layouts, timeout=400):
    import io

    raw = run_distributed(job, world, hf_dir, layouts, timeout=timeout)
    return [torch.load(io.BytesIO(b), weights_only=False) for b in raw]


def test_shared_equals_packed_and_padded_tp1(hf_model_dir):
    """World 1: fixed micro-batches of 5 (groups kept together: the plan takes rows group after group), a token
    budget (groups cut where they do not fit), full activation recompute; and the automatic choice, which leaves
    this batch's short prompts unshared (tests/unit/test_prefix_sharing.py checks where it shares)."""
    hf_dir = hf_model_dir("qwen2")
    modes = PACKED_SHARED + (("padded", {"packed": False}), ("auto", {"packed": True, "share_prefix": None}))
    layouts = [({}, {"micro_batch_size": 5}, modes), ({}, {"use_dynamic_bsz": True, "max_token_len": 45}, modes),
               ({"recompute": True}, {"micro_batch_size": 12}, PACKED_SHARED)]
    (per_layout,) = spawn(1, hf_dir, layouts, timeout=300)
    for (layout, micro, modes_), res in zip(layouts, per_layout):
        check(res, f"tp1 {micro}")
        close(res["actor_shared_topk"], res["actor_packed_topk"], f"tp1 {micro} top-k log-probs")
        assert torch.equal(res["actor_shared_topk_ids"], res["actor_packed_topk_ids"])
        assert "SharedPack" in res["actor_shared_packs"] and "SharedPack" not in res["actor_packed_packs"]
        if len(modes_) > 2:
            check(res, f"tp1 {micro} padded", want="padded")
            check(res, f"tp1 {micro} auto", got="auto")
            assert res["actor_auto_packs"] == res["actor_packed_packs"]
    # a 45-token budget holds prompt 0's group (19 + 5 + 1 + 9 + 8 tokens) whole and cuts prompt 1's (6 + 12 + 1 + 30)
    assert per_layout[1]["actor_shared_packs"].count("SharedPack") >= 1


@pytest.mark.long
def test_shared_equals_packed_tp2_sp_pp2_vpp2_dp2(hf_model_dir):
    hf_dir = hf_model_dir("qwen2")
    dyn = {"use_dynamic_bsz": True, "max_token_len": 90}
    layouts = [({"tp": 2}, dyn, PACKED_SHARED), ({"tp": 2, "sequence_parallel": True}, dyn, PACKED_SHARED),
               ({"pp": 2}, {"micro_batch_size": 4}, PACKED_SHARED), ({"pp": 2, "vpp": 2}, dyn, PACKED_SHARED),
               ({}, dyn, PACKED_SHARED)]
    per_rank = spawn(2, hf_dir, layouts)
    for r in range(2):
        for (layout, micro, _), res in zip(layouts, per_rank[r]):
            check(res, f"rank {r} {layout or 'dp2'} {micro}")


@pytest.mark.long
def test_shared_equals_packed_moe_ep2_tp2(hf_model_dir):
    hf_dir = hf_model_dir("qwen3_moe")
    layouts = [({"tp": 2, "ep": 2, "sequence_parallel": True}, {"use_dynamic_bsz": True, "max_token_len": 90}, PACKED_SHARED)]
    for r, res in enumerate(spawn(4, hf_dir, layouts)):
        check(res[0], f"rank {r} ep2 tp2")


def test_shared_equals_unshared_cp2(hf_model_dir):
    """Context parallelism: each group of one prompt runs as one tree row split over the two CP ranks
    (`prefix_cp`); log-probs, entropy, values, step metrics and gradients equal the unshared CP2 path's on both
    ranks, and the automatic choice leaves this batch's short prompts unshared."""
    hf_dir = hf_model_dir("qwen2")
    modes = PACKED_SHARED + (("auto", {"packed": True, "share_prefix": None}),)
    layouts = [({"cp": 2}, {"micro_batch_size": 6}, modes)]
    for r, res in enumerate(spawn(2, hf_dir, layouts, timeout=300)):
        check(res[0], f"rank {r} cp2")
        check(res[0], f"rank {r} cp2 auto", got="auto")
        assert res[0]["actor_shared_rows"] == ["TreeRows"] * 2 and res[0]["actor_auto_rows"] == ["PlainRows"] * 2


@pytest.mark.long  # CP2 itself: test_shared_equals_unshared_cp2
def test_shared_cp2_equals_one_rank_and_cp2_tp2_sp_pp2(hf_model_dir):
    """Shared CP2 (fixed and dynamic micro-batches) against the one-rank packed path; shared CP2 x TP2 with
    sequence parallelism, CP2 x PP2 and CP2 x PP2 x VPP2 against their unshared paths."""
    hf_dir = hf_model_dir("qwen2")
    dyn = {"use_dynamic_bsz": True, "max_token_len": 90}
    micro = ({"micro_batch_size": 6}, dyn)
    (one,) = spawn(1, hf_dir, [({}, m, PACKED_SHARED) for m in micro], timeout=300)
    for r, res in enumerate(spawn(2, hf_dir, [({"cp": 2}, m, PACKED_SHARED) for m in micro], timeout=300)):
        for m, cp, single in zip(micro, res, one):
            merged = {**single, **{k.replace("_shared_", "_cp2_"): v for k, v in cp.items() if "_shared_" in k}}
            check(merged, f"rank {r} cp2 {m} against one rank", got="cp2", want="packed")
    layouts = [({"cp": 2, "tp": 2, "sequence_parallel": True}, dyn, PACKED_SHARED),
               ({"cp": 2, "pp": 2}, {"micro_batch_size": 4}, PACKED_SHARED),
               ({"cp": 2, "pp": 2, "vpp": 2}, dyn, PACKED_SHARED)]  # tree rows padded to one shape
    for r, res in enumerate(spawn(4, hf_dir, layouts)):
        for (layout, m, _), got in zip(layouts, res):
            check(got, f"rank {r} {layout} {m}")
            assert "TreeRows" in got["actor_shared_rows"]


@pytest.mark.long  # CP2 itself: test_shared_equals_unshared_cp2
def test_shared_equals_unshared_moe_cp2_ep2(hf_model_dir):
    """Qwen3-MoE at CP2 x EP2 (DP2, 4 ranks): tree rows whose experts take tokens from both CP ranks' chunks."""
    hf_dir = hf_model_dir("qwen3_moe")
    layouts = [({"cp": 2, "ep": 2}, {"use_dynamic_bsz": True, "max_token_len": 90}, PACKED_SHARED)]
    for r, res in enumerate(spawn(4, hf_dir, layouts)):
        check(res[0], f"rank {r} moe cp2 ep2")
        assert "TreeRows" in res[0]["actor_shared_rows"]


@pytest.mark.long  # the layouts' exactness: test_shared_equals_packed_and_padded_tp1
@pytest.mark.e2e
def test_grpo_run_logs_the_same_metrics_shared(tmp_path):
    """recipes/cpu/tiny_grpo.yaml (4 samples a prompt) for 3 steps with use_prefix_sharing forced on and off: the
    same rewards and lengths exactly, losses, KL and gradient norms within float tolerance."""
    from megappo.config import load_config
    from megappo.testing.prompts import read_metrics
    from megappo.trainer import fit

    runs = {}
    for share in ("false", "true"):
        out = tmp_path / share
        assert fit(load_config("cpu/tiny_grpo", [
            f"trainer.default_local_dir={out}", "trainer.logger=[]", "trainer.total_training_steps=3",
            "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.val_before_train=false",
            f"actor_rollout_ref.model.use_prefix_sharing={share}"])) == 0
        runs[share] = read_metrics(str(out))
    assert [r["step"] for r in runs["true"]] == [r["step"] for r in runs["false"]] == [1, 2, 3]
    for a, b in zip(runs["false"], runs["true"]):
        for k in ("reward/mean", "response/length_mean"):
            assert b[k] == a[k], k
        for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss", "rollout/logprob_diff_mean"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
