"""LoRA adapters on megatron's linear layers (megappo.models.lora) at TP=1, TP=2 and PP=2 (gloo, fp32).

Each layout: an actor with adapters (B = 0) gives the base model's log-probs; a step trains only the adapters (the
base has no gradient and no optimizer state); adapters off give exactly what a separately loaded reference gives;
the merged export, loaded as a plain model, gives the LoRA model's log-probs; an adapter-only checkpoint (no base
tensors in it) restores the adapters and the optimizer. TP=2's and PP=2's loss, gradient norm and merged weights
equal one rank's. MoE: adapters on the experts at EP=1 and EP=2.
"""
from __future__ import annotations

import pytest
import torch

from megappo.testing.dist import run_distributed

pytestmark = pytest.mark.multirank

REL = 1e-5


def _batch():
    from megappo.testing.batches import random_batch

    return random_batch(11, [3, 7, 2, 5], [6, 2, 9, 4], old_log_prob=-6.2)


def _loss(out, ctx):
    m = ctx.batch.response_mask.float()
    ratio = torch.exp(out.log_probs - ctx.batch.train.old_log_probs)
    return -(ratio * ctx.batch.train.advantages * m).sum() / ctx.global_num_tokens, {}


def _rel(a, b):
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)


def _job(rank, world_size, hf_dir, tmp, layout):
    import os

    import torch.distributed as dist

    from megappo.config.schema import LoRAConfig
    from megappo.kinds.build import build_model
    from megappo.kinds.weights import hf_state_dict, iter_hf_weights, load_hf_weights
    from megappo.models.checkpoint import load_model_checkpoint, save_model_checkpoint
    from megappo.models.compute import compute_log_probs, train_step
    from megappo.models.hf_config import load_hf_config_dict
    from megappo.models.lora import adapters, adapters_disabled, apply_lora
    from megappo.models.optim import OptimSettings, build_optimizer, build_scheduler, wrap_ddp
    from megappo.parallel import destroy_parallel, init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout
    from megappo.trainer.checkpointing import write_actor_hf_dir
    from megappo.trainer.settings import lora_settings

    plat = detect_platform()
    ps = init_parallel(ParallelLayout(**layout), plat, seed=0)
    tag = "_".join(f"{k}{v}" for k, v in layout.items()) or "single"
    hf_cfg = load_hf_config_dict(hf_dir)
    batch = _batch()
    out = {}
    ref = build_model(hf_dir, "ref", ps, plat, seed=3)
    load_hf_weights(ref, hf_dir, ps)
    ref_lp, _ = compute_log_probs(ref, batch, parallel_state=ps)

    actor = build_model(hf_dir, "actor", ps, plat, seed=3)
    load_hf_weights(actor, hf_dir, ps)
    ads = apply_lora(actor, lora_settings(LoRAConfig(rank=4, alpha=8.0), seed=5))
    lp0, _ = compute_log_probs(actor, batch, parallel_state=ps)
    out["b0_err"] = _rel(lp0, ref_lp)
    settings = OptimSettings(lr=2e-2, eps=1e-3, weight_decay=0.0, clip_grad=1.0, total_steps=4)
    ddp = wrap_ddp(actor, settings, plat)
    opt = build_optimizer(ddp, settings, plat)
    sched = build_scheduler(opt, settings)
    opt_params = [p for g in opt.param_groups for p in g["params"]]
    out["opt_params"] = len(opt_params)
    out["adapter_params"] = 2 * len(ads)
    out["base_grads"] = sum(1 for c in ddp for n, p in c.named_parameters()
                            if ".lora." not in n and (p.requires_grad or getattr(p, "main_grad", None) is not None))
    m = None
    for _ in range(2):
        m = train_step(ddp, opt, sched, batch, _loss, parallel_state=ps, platform=plat)
    out["loss"], out["grad_norm"] = m.loss, m.grad_norm
    out["b_norm"] = sum(a.lora_B.detach().abs().sum().item() for a in adapters(ddp))
    lp, _ = compute_log_probs(ddp, batch, parallel_state=ps)
    out["moved"] = _rel(lp, ref_lp)
    with adapters_disabled(ddp):
        off, _ = compute_log_probs(ddp, batch, parallel_state=ps)
    out["off_err"] = (off - ref_lp).abs().max().item()
    merged = hf_state_dict(ddp, ps, hf_cfg)
    changed = {n for b in iter_hf_weights(list(ddp), ps, hf_cfg, only_adapted=True) for n, _ in b}
    out["changed"] = sorted(changed)
    out["merged"] = merged
    # the merged export as a plain model gives the LoRA model's log-probs
    mdir = os.path.join(tmp, f"merged_{tag}")
    write_actor_hf_dir(iter_hf_weights(list(ddp), ps, hf_cfg), hf_cfg, hf_dir, mdir, torch.float32)
    plain = build_model(mdir, "ref", ps, plat, seed=3)
    load_hf_weights(plain, mdir, ps)
    out["merged_err"] = _rel(compute_log_probs(plain, batch, parallel_state=ps)[0], lp)
    # adapter-only checkpoint: save, disturb, load back
    cdir = os.path.join(tmp, f"ckpt_{tag}")
    save_model_checkpoint(ddp, cdir, optimizer=opt, scheduler_state=sched.state_dict())
    from megatron.core.dist_checkpointing import load_tensors_metadata

    out["ckpt_keys"] = sorted(load_tensors_metadata(cdir))
    saved_b = [a.lora_B.detach().clone() for a in adapters(ddp)]
    train_step(ddp, opt, sched, batch, _loss, parallel_state=ps, platform=plat)
    after_one_more = compute_log_probs(ddp, batch, parallel_state=ps)[0]
    load_model_checkpoint(ddp, cdir, optimizer=opt)
    out["restored_err"] = max((a.lora_B - b).abs().max().item() for a, b in zip(adapters(ddp), saved_b))
    train_step(ddp, opt, sched, batch, _loss, parallel_state=ps, platform=plat)
    out["replay_err"] = _rel(compute_log_probs(ddp, batch, parallel_state=ps)[0], after_one_more)
    dist.barrier()
    destroy_parallel()
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def results(hf_model_dir, tmp_path_factory):
    hf_dir = hf_model_dir("qwen2")
    tmp = str(tmp_path_factory.mktemp("lora"))
    return [run_distributed(_job, n, hf_dir, tmp, layout, timeout=300)[0]
            for n, layout in ((1, {}), (2, {"tp": 2}), (2, {"pp": 2}))]


@pytest.mark.parametrize("i", [0, 1, 2], ids=["tp1", "tp2", "pp2"])
def test_lora_layout(results, i):
    r = results[i]
    assert r["b0_err"] == 0.0, "B = 0 must give the base model"
    assert r["base_grads"] == 0 and r["opt_params"] == r["adapter_params"]
    assert r["b_norm"] > 0 and r["moved"] > 1e-4, "the step must change the adapters and the policy"
    assert r["off_err"] <= 1e-6, "adapters off must equal a separately loaded reference"
    assert r["merged_err"] <= REL, r["merged_err"]
    assert r["changed"] and all(n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                                            "gate_proj.weight", "up_proj.weight", "down_proj.weight"))
                                for n in r["changed"])
    assert all(".lora." in k for k in r["ckpt_keys"]), [k for k in r["ckpt_keys"] if ".lora." not in k][:5]
    assert r["restored_err"] == 0.0 and r["replay_err"] <= REL


@pytest.mark.parametrize("i", [1, 2], ids=["tp2", "pp2"])
def test_layouts_equal_single_rank(results, i):
    r1, r2 = results[0], results[i]
    assert abs(r2["loss"] - r1["loss"]) <= REL * abs(r1["loss"])
    assert abs(r2["grad_norm"] - r1["grad_norm"]) <= REL * r1["grad_norm"]
    assert r1["merged"].keys() == r2["merged"].keys()
    for k in r1["merged"]:
        assert _rel(r2["merged"][k], r1["merged"][k]) <= REL, k


def _moe_job(rank, world_size, hf_dir, tmp, ep, extra=None):
    """A MoE model: adapters on the experts too; B = 0 is the base, one step at EP=ep, the merged export as a plain
    model gives the LoRA log-probs."""
    import os

    from megappo.config.schema import LoRAConfig
    from megappo.kinds.build import build_model
    from megappo.kinds.weights import hf_state_dict, iter_hf_weights, load_hf_weights
    from megappo.models.compute import compute_log_probs, train_step
    from megappo.models.hf_config import load_hf_config_dict
    from megappo.models.lora import adapters, apply_lora
    from megappo.models.optim import OptimSettings, build_optimizer, build_scheduler, wrap_ddp
    from megappo.parallel import destroy_parallel, init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout
    from megappo.trainer.checkpointing import write_actor_hf_dir
    from megappo.trainer.settings import lora_settings

    plat = detect_platform()
    ps = init_parallel(ParallelLayout(ep=ep, **(extra or {})), plat, seed=0)
    hf_cfg = load_hf_config_dict(hf_dir)
    full = _batch()
    batch = full.select(torch.arange(full.batch_size).chunk(ps.dp_size)[ps.dp_rank])  # this DP rank's rows
    actor = build_model(hf_dir, "actor", ps, plat, seed=3)
    load_hf_weights(actor, hf_dir, ps)
    base_lp, _ = compute_log_probs(actor, batch, parallel_state=ps)
    ads = apply_lora(actor, lora_settings(LoRAConfig(rank=4, alpha=8.0), seed=5))
    out = {"experts": sum(".local_experts." in a.name for a in ads),
           "b0_err": _rel(compute_log_probs(actor, batch, parallel_state=ps)[0], base_lp)}
    settings = OptimSettings(lr=2e-2, eps=1e-3, weight_decay=0.0, clip_grad=1.0, total_steps=4)
    ddp = wrap_ddp(actor, settings, plat, pg_collection=ps.pg_collection)
    opt = build_optimizer(ddp, settings, plat)
    m = train_step(ddp, opt, build_scheduler(opt, settings), batch, _loss, parallel_state=ps, platform=plat)
    out["loss"], out["grad_norm"] = m.loss, m.grad_norm
    out["expert_b"] = sum(a.lora_B.abs().sum().item() for a in adapters(ddp) if ".local_experts." in a.name)
    lp, _ = compute_log_probs(ddp, batch, parallel_state=ps)
    mdir = os.path.join(tmp, f"moe_merged_ep{ep}_{sorted((extra or {}).items())}")
    write_actor_hf_dir(iter_hf_weights(list(ddp), ps, hf_cfg), hf_cfg, hf_dir, mdir, torch.float32)
    plain = build_model(mdir, "ref", ps, plat, seed=3)
    load_hf_weights(plain, mdir, ps)
    out["merged_err"] = _rel(compute_log_probs(plain, batch, parallel_state=ps)[0], lp)
    out["merged"] = hf_state_dict(ddp, ps, hf_cfg)
    if extra:  # the adapters' checkpoint at this layout, for a one-rank load (sharded like the base weights)
        from megappo.models.checkpoint import save_model_checkpoint

        save_model_checkpoint(ddp, os.path.join(tmp, "moe_ckpt"))
    destroy_parallel()
    return out if rank == 0 else None


def _moe_load_job(rank, world_size, hf_dir, ckpt):
    from megappo.config.schema import LoRAConfig
    from megappo.kinds.build import build_model
    from megappo.kinds.weights import hf_state_dict, load_hf_weights
    from megappo.models.checkpoint import load_model_checkpoint
    from megappo.models.hf_config import load_hf_config_dict
    from megappo.models.lora import apply_lora
    from megappo.parallel import destroy_parallel, init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout
    from megappo.trainer.settings import lora_settings

    plat = detect_platform()
    ps = init_parallel(ParallelLayout(), plat, seed=0)
    actor = build_model(hf_dir, "actor", ps, plat, seed=3)
    load_hf_weights(actor, hf_dir, ps)
    apply_lora(actor, lora_settings(LoRAConfig(rank=4, alpha=8.0), seed=5))
    load_model_checkpoint(actor, ckpt)
    out = hf_state_dict(actor, ps, load_hf_config_dict(hf_dir))
    destroy_parallel()
    return out


def test_lora_on_moe_experts(hf_model_dir, tmp_path):
    hf_dir = hf_model_dir("qwen3_moe")
    r1 = run_distributed(_moe_job, 1, hf_dir, str(tmp_path), 1, timeout=300)[0]
    r2 = run_distributed(_moe_job, 2, hf_dir, str(tmp_path), 2, timeout=300)[0]
    for r in (r1, r2):
        assert r["experts"] > 0 and r["b0_err"] == 0.0
        assert r["expert_b"] > 0, "the experts' adapters must train"
        assert r["merged_err"] <= REL, r["merged_err"]
    assert abs(r2["loss"] - r1["loss"]) <= REL * abs(r1["loss"])
    assert abs(r2["grad_norm"] - r1["grad_norm"]) <= REL * r1["grad_norm"]
    assert r1["merged"].keys() == r2["merged"].keys()
    for k in r1["merged"]:
        assert _rel(r2["merged"][k], r1["merged"][k]) <= REL, k


@pytest.mark.long
def test_sequence_parallel_equals_single_rank(results, hf_model_dir, tmp_path):
    """TP=2 with sequence parallelism: the adapters' rank-r activations are gathered / reduce-scattered along the
    sequence and the replicated factor's gradient summed over TP."""
    r1 = results[0]
    r2 = run_distributed(_job, 2, hf_model_dir("qwen2"), str(tmp_path), {"tp": 2, "sequence_parallel": True},
                         timeout=300)[0]
    test_lora_layout([r2], 0)
    assert abs(r2["loss"] - r1["loss"]) <= REL * abs(r1["loss"])
    assert abs(r2["grad_norm"] - r1["grad_norm"]) <= REL * r1["grad_norm"]
    for k in r1["merged"]:
        assert _rel(r2["merged"][k], r1["merged"][k]) <= REL, k


@pytest.mark.long  # ~1-2 min on the 2-core machine; EP=2 above covers the experts' adapters at one layout
def test_lora_on_experts_with_expert_tensor_parallel(hf_model_dir, tmp_path):
    """TP=2 with sequence parallelism, expert_tensor_parallel_size = TP = 2 (megappo's default): each expert's
    weight is split over two ranks; the dispatcher hands both the same tokens and sums their partial outputs, the
    adapters' replicated factors sum their gradients over expert-TP. Loss, gradient norm and merged weights equal
    one rank's, and the checkpoint saved there loads at one rank."""
    hf_dir = hf_model_dir("qwen3_moe")
    r1 = run_distributed(_moe_job, 1, hf_dir, str(tmp_path), 1, timeout=300)[0]
    r2 = run_distributed(_moe_job, 2, hf_dir, str(tmp_path), 1, {"tp": 2, "sequence_parallel": True}, timeout=300)[0]
    assert r2["experts"] > 0 and r2["b0_err"] == 0.0 and r2["expert_b"] > 0
    assert r2["merged_err"] <= REL, r2["merged_err"]
    assert abs(r2["loss"] - r1["loss"]) <= REL * abs(r1["loss"])
    assert abs(r2["grad_norm"] - r1["grad_norm"]) <= REL * r1["grad_norm"], (r1["grad_norm"], r2["grad_norm"])
    loaded = run_distributed(_moe_load_job, 1, hf_dir, str(tmp_path / "moe_ckpt"), timeout=300)[0]
    for k in r1["merged"]:
        assert _rel(r2["merged"][k], r1["merged"][k]) <= REL, k
        assert torch.equal(loaded[k], r2["merged"][k]), k  # the expert-TP checkpoint loads at one rank
