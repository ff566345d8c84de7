"""Log-probs (entropy, sum_v p_v^2), values, losses, gradients and one optimizer step agree across parallel layouts
(gloo, fp32).

One spawned job per world size runs every layout of that size in turn (a process start costs ~10 s):
world 1 is the reference (fixed micro-batches, plus a dynamic-micro-batch step whose gradient must equal the fixed
one); world 2 runs TP=2, PP=2, PP=2 x VPP=2 and DP=2 (distributed optimizer), and EP=2 for a MoE model; world 4
runs TP2xPP2. The parallel layouts use
dynamic micro-batches, so agreeing with the reference also shows that packing does not change the result.
Every layout loads the same Hugging Face weights; the critic's fresh value head is seeded identically.
Gradients and updated weights are compared under their Hugging Face names, merged over TP and PP.
"""
from __future__ import annotations

import pytest
import torch

from megappo.testing.dist import run_distributed

pytestmark = pytest.mark.multirank

FAMILY = "qwen2"
REL = 1e-5  # max |a - b| / max |b| per tensor


def _make_batch():
    from megappo.models.batch import ModelBatch, TrainInputs

    g = torch.Generator().manual_seed(7)
    plens, rlens = [3, 9, 2, 5, 7, 4, 6, 1], [6, 2, 11, 4, 1, 8, 3, 5]
    prompts = [torch.randint(1, 400, (n,), generator=g).tolist() for n in plens]
    responses = [torch.randint(1, 400, (n,), generator=g).tolist() for n in rlens]
    b = ModelBatch.from_token_lists(prompts, responses, pad_token_id=0)
    shape = b.response_mask.shape
    b.train = TrainInputs(
        old_log_probs=-6.2 + 0.1 * torch.randn(shape, generator=g),
        advantages=torch.randn(shape, generator=g),
        returns=torch.randn(shape, generator=g),
    )
    return b


def _actor_loss(out, ctx):
    """PPO clipped surrogate with an entropy bonus, token-mean over the global mini-batch."""
    m = ctx.batch.response_mask.float()
    t = ctx.batch.train
    ratio = torch.exp(out.log_probs - t.old_log_probs)
    pg = -torch.minimum(ratio * t.advantages, ratio.clamp(0.8, 1.2) * t.advantages)
    pg_loss = (pg * m).sum() / ctx.global_num_tokens
    ent = (out.entropy * m).sum() / ctx.global_num_tokens
    metrics = {"pg_loss": pg_loss.detach() * ctx.num_micro_batches, "ratio": (ratio * m).sum() / m.sum()}
    return pg_loss - 0.01 * ent, metrics


def _critic_loss(out, ctx):
    m = ctx.batch.response_mask.float()
    return 0.5 * (((out.values - ctx.batch.train.returns) ** 2) * m).sum() / ctx.global_num_tokens, {}


def _grads_hf(chunks, ps, hf_cfg):
    """The DDP grad buffers (param.main_grad) under HF names, merged over TP/PP (collective)."""
    from megappo.kinds.weights import hf_state_dict

    params = [p for c in chunks for p in c.parameters()]
    saved = [p.data for p in params]
    for p in params:
        p.data = p.main_grad.view_as(p)
    try:
        return hf_state_dict(chunks, ps, hf_cfg)
    finally:
        for p, d in zip(params, saved):
            p.data = d


def _run_layout(layout_kw, hf_dir, micro_kw, dist_opt, check_dynamic):
    import torch.distributed as dist

    from megappo.kinds.build import build_model
    from megappo.kinds.weights import hf_state_dict, load_hf_weights
    from megappo.models.compute import MicroBatching, compute_log_probs, compute_values, train_step
    from megappo.models.hf_config import load_hf_config_dict
    from megappo.models.optim import OptimSettings, build_optimizer, build_scheduler, wrap_ddp
    from megappo.parallel import destroy_parallel, init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout

    plat = detect_platform()
    ps = init_parallel(ParallelLayout(**layout_kw), plat, seed=0)
    hf_cfg = load_hf_config_dict(hf_dir)
    full = _make_batch()
    rows = torch.arange(full.batch_size).chunk(ps.dp_size)[ps.dp_rank]  # this DP rank's share
    batch = full.select(rows)
    micro = MicroBatching(**micro_kw)
    # Adam's first update is lr * g / (|g| + eps): near g = 0 it multiplies the gradient's float noise (~1e-5
    # relative, layout-dependent summation order) by lr / eps. eps 1e-3 keeps that far below the tolerance while
    # the update stays Adam-normalised for every gradient that matters.
    settings = OptimSettings(lr=1e-3, eps=1e-3, weight_decay=0.01, clip_grad=0.0, total_steps=4,
                             use_distributed_optimizer=dist_opt)
    out = {"rows": rows, "reporter": ps.tp_rank == 0 and ps.pp_rank == 0}

    for role, loss_fn in (("actor", _actor_loss), ("critic", _critic_loss)):
        chunks = build_model(hf_dir, role, ps, plat, seed=3)
        load_hf_weights(chunks, hf_dir, ps)
        if role == "actor":
            out["log_probs"], out["entropy"], out["sum_pi_squared"] = compute_log_probs(
                chunks, batch, parallel_state=ps, micro=micro, calculate_entropy=True, calculate_sum_pi_squared=True)
        else:
            out["values"] = compute_values(chunks, batch, parallel_state=ps, micro=micro)
        ddp = wrap_ddp(chunks, settings, plat)
        ddp_params = [p for c in ddp for p in c.parameters()]
        opt = build_optimizer(ddp, settings, plat)
        sched = build_scheduler(opt, settings)
        initial = [p.detach().clone() for p in ddp_params] if check_dynamic else None
        metrics = train_step(ddp, opt, sched, batch, loss_fn, parallel_state=ps, micro=micro,
                             calculate_entropy=role == "actor", platform=plat)
        out[f"{role}_metrics"] = metrics
        grads = None if dist_opt else _grads_hf(ddp, ps, hf_cfg)  # distributed optimizer: grads are sharded
        weights = hf_state_dict(ddp, ps, hf_cfg)
        if check_dynamic:  # the same weights again, dynamic micro-batches: the gradient must not change
            for p, w in zip(ddp_params, initial):
                p.data.copy_(w)
            train_step(ddp, opt, None, batch, loss_fn, parallel_state=ps, calculate_entropy=role == "actor",
                       micro=MicroBatching(use_dynamic_bsz=True, max_token_len=40), platform=plat)
            out[f"{role}_grads_dynamic"] = _grads_hf(ddp, ps, hf_cfg)
        if dist.get_rank() == 0:
            out[f"{role}_grads"], out[f"{role}_weights"] = grads, weights
    destroy_parallel()
    return out


def _job(rank, world_size, hf_dir, layouts):
    import io

    results = [_run_layout(args[0], hf_dir, *args[1:]) for args in layouts]
    # Bytes, not tensors: torch.multiprocessing passes tensors as shared-memory handles that vanish with the rank.
    buf = io.BytesIO()
    torch.save(results, buf)
    return buf.getvalue()


def _spawn(world_size, hf_dir, layouts, timeout):
    import io

    raw = run_distributed(_job, world_size, hf_dir, layouts, timeout=timeout)
    return [torch.load(io.BytesIO(b), weights_only=False) for b in raw]


def _close(a, b, what):
    err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)
    assert err <= REL, f"{what}: relative error {err:.2e} > {REL}"


def _close_dicts(got, ref, what):
    assert got.keys() == ref.keys(), f"{what}: tensor names differ: {set(got) ^ set(ref)}"
    for k in ref:
        _close(got[k], ref[k], f"{what} {k}")


_REFERENCES: dict[str, tuple] = {}


@pytest.fixture(scope="module")
def reference(hf_model_dir):
    """reference(family) -> (hf_dir, world-1 results), computed once per family."""

    def get(family: str = FAMILY):
        if family not in _REFERENCES:
            hf_dir = hf_model_dir(family)
            (ref,) = _spawn(1, hf_dir, [({}, {"micro_batch_size": 3}, False, True)], timeout=300)[0]
            _REFERENCES[family] = (hf_dir, ref)
        return _REFERENCES[family]

    return get


def _compare(results, ref, dist_opt=False):
    """results: one layout's per-rank outputs. Assemble DP shards and check everything against the reference."""
    reporters = [r for r in results if r["reporter"]]
    for key in ("log_probs", "entropy", "sum_pi_squared", "values"):
        got = torch.zeros_like(ref[key])
        for r in reporters:
            got[r["rows"]] = r[key]
        _close(got, ref[key], key)
    for r in results:  # every rank, of every stage, returns the same per-token results and metrics
        _close(r["log_probs"], reporters[0]["log_probs"] if len(reporters) == 1 else r["log_probs"], "log_probs")
    for role in ("actor", "critic"):
        m, mr = results[0][f"{role}_metrics"], ref[f"{role}_metrics"]
        assert abs(m.loss - mr.loss) <= REL * abs(mr.loss), (role, m.loss, mr.loss)
        assert abs(m.grad_norm - mr.grad_norm) <= REL * mr.grad_norm, (role, m.grad_norm, mr.grad_norm)
        assert m.lr == mr.lr and set(m.metrics) == set(mr.metrics)
        assert all(r[f"{role}_metrics"].loss == m.loss for r in results)
        if not dist_opt:
            _close_dicts(results[0][f"{role}_grads"], ref[f"{role}_grads"], f"{role} grad")
        _close_dicts(results[0][f"{role}_weights"], ref[f"{role}_weights"], f"{role} weight after step")


def test_reference_dynamic_micro_batches_give_the_same_gradient(reference):
    _, ref = reference()
    for role in ("actor", "critic"):
        _close_dicts(ref[f"{role}_grads_dynamic"], ref[f"{role}_grads"], f"{role} grad dynamic vs fixed")
    assert ref["actor_metrics"].num_micro_batches == 3
    assert ref["actor_metrics"].grad_norm > 0 and ref["actor_metrics"].update_successful


def test_tp2_pp2_vpp2_dp2_match_single_rank(reference):
    hf_dir, ref = reference()
    dyn = {"use_dynamic_bsz": True, "max_token_len": 48}
    layouts = [({"tp": 2}, dyn, False, False), ({"pp": 2}, dyn, False, False), ({"pp": 2, "vpp": 2}, dyn, False, False),
               ({}, dyn, True, False)]
    per_rank = _spawn(2, hf_dir, layouts, timeout=400)
    for i, name in enumerate(["tp2", "pp2", "pp2 vpp2", "dp2 distributed optimizer"]):
        results = [per_rank[r][i] for r in range(2)]
        _compare(results, ref, dist_opt=layouts[i][2])


def test_tp2xpp2_matches_single_rank(reference):
    hf_dir, ref = reference()
    layouts = [({"tp": 2, "pp": 2}, {"use_dynamic_bsz": True, "max_token_len": 48}, False, False)]
    per_rank = _spawn(4, hf_dir, layouts, timeout=400)
    _compare([per_rank[r][0] for r in range(4)], ref)


def test_moe_ep2_matches_single_rank(reference):
    """Qwen3-MoE (4 experts, top-2) at EP=2: experts split over the two ranks, which are also DP=2."""
    hf_dir, ref = reference("qwen3_moe")
    layouts = [({"ep": 2}, {"use_dynamic_bsz": True, "max_token_len": 48}, False, False)]
    per_rank = _spawn(2, hf_dir, layouts, timeout=400)
    _compare([per_rank[r][0] for r in range(2)], ref)


def test_lr_schedule_constant_and_cosine_with_warmup():
    """megatron's OptimizerParamScheduler as build_scheduler configures it (in process: it only sets lrs)."""
    from megappo.models.optim import OptimSettings, build_scheduler

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.0)

    def lrs(**kw):
        sched = build_scheduler(opt, OptimSettings(lr=1.0, total_steps=10, **kw))
        out = []
        for _ in range(11):
            out.append(opt.param_groups[0]["lr"])
            sched.step(1)
        return out, sched

    constant, _ = lrs()
    assert constant == [1.0] * 11
    cosine, sched = lrs(lr_scheduler="cosine", lr_warmup_steps_ratio=0.2, min_lr_ratio=0.1)
    assert cosine[:3] == pytest.approx([0.0, 0.5, 1.0])  # linear warmup over 2 steps
    assert cosine[10] == pytest.approx(0.1) and all(a >= b for a, b in zip(cosine[2:], cosine[3:]))
    state = sched.state_dict()
    resumed = build_scheduler(opt, OptimSettings(lr=1.0, total_steps=10, lr_scheduler="cosine",
                                                 lr_warmup_steps_ratio=0.2, min_lr_ratio=0.1))
    resumed.load_state_dict(state)
    assert resumed.num_steps == sched.num_steps
    with pytest.raises(ValueError, match="lr_scheduler"):
        build_scheduler(opt, OptimSettings(lr_scheduler="linear"))


def _compare_cp(results, ref, dist_opt=False):
    """Every CP rank returns the whole [b, r] outputs and the same metrics; together they match the reference."""
    _compare(results, ref, dist_opt=dist_opt)
    for r in results:  # the ranks of one data-parallel replica (the same rows) return the same tensors
        same = next(o for o in results if torch.equal(o["rows"], r["rows"]))
        for key in ("log_probs", "entropy", "sum_pi_squared", "values"):
            assert torch.equal(r[key], same[key]), f"{key} differs between CP ranks"


def test_cp2_matches_single_rank(reference):
    """Context parallelism (megatron's 2*cp-chunk layout, megappo's SDPAttention all-gathering K/V): log-probs,
    entropy, values, losses, gradients and the updated weights equal CP=1, fixed and dynamic micro-batches."""
    hf_dir, ref = reference()
    layouts = [({"cp": 2}, {"micro_batch_size": 3}, False, False),
               ({"cp": 2}, {"use_dynamic_bsz": True, "max_token_len": 48, "packed": True}, False, False)]
    per_rank = _spawn(2, hf_dir, layouts, timeout=400)
    for i in range(len(layouts)):
        _compare_cp([per_rank[r][i] for r in range(2)], ref)


@pytest.mark.long
def test_cp2_with_tp2_dp2_pp2_matches_single_rank(reference):
    hf_dir, ref = reference()
    dyn = {"use_dynamic_bsz": True, "max_token_len": 48}
    layouts = [({"cp": 2, "tp": 2}, dyn, False, False), ({"cp": 2}, dyn, True, False),
               ({"cp": 2, "tp": 2, "sequence_parallel": True}, {"micro_batch_size": 3}, False, False),
               ({"cp": 2, "pp": 2}, dyn, False, False)]
    per_rank = _spawn(4, hf_dir, layouts, timeout=600)
    for i in range(len(layouts)):
        _compare_cp([per_rank[r][i] for r in range(4)], ref, dist_opt=layouts[i][2])


@pytest.mark.long
def test_moe_cp2_ep2_matches_single_rank(reference):
    """Qwen3-MoE at CP2 x EP2 on 4 ranks (DP2): the experts' tokens come from both CP ranks' sequence chunks."""
    hf_dir, ref = reference("qwen3_moe")
    layouts = [({"cp": 2, "ep": 2}, {"use_dynamic_bsz": True, "max_token_len": 48}, False, False)]
    per_rank = _spawn(4, hf_dir, layouts, timeout=600)
    _compare_cp([per_rank[r][0] for r in range(4)], ref)
