"""MoE router replay at EP2 x TP2 (4 gloo ranks, DP2; sequence parallelism, which megatron needs for a MoE at
TP > 1): each rank replays the engine's global expert ids for its data-parallel share and its TP rank's share of
the tokens, in packed micro-batches, and the trainer's log-probs of the engine's samples equal the engine's
on a router close to ties; routing freely they do not. The one-rank case is tests/unit/test_router_replay.py."""
from __future__ import annotations

import pytest
import torch

from megappo.testing.dist import run_distributed
from megappo.testing.moe_ties import engine_vs_trainer, make_tied_moe, replay_grads, route_differences, tie_prompts

pytestmark = pytest.mark.multirank


# ~32 s each (4 ranks): the long tier; tests/unit/test_router_replay.py covers replay at one rank in the default one
EP2_TP2 = (4, {"tp": 2, "ep": 2, "sequence_parallel": True}, {"use_dynamic_bsz": True, "max_token_len": 64,
                                                              "packed": True})
PP2 = (2, {"pp": 2}, {"micro_batch_size": 2})  # each stage replays its own layers' routes (padded micro-batches)
CP2 = (2, {"cp": 2}, {"micro_batch_size": 4})  # each CP rank replays its two chunks' routes


@pytest.mark.long
@pytest.mark.parametrize("family, layout", [("qwen3_moe", EP2_TP2), ("qwen2_moe", EP2_TP2), ("qwen3_moe", PP2),
                                            ("qwen3_moe", CP2)],
                         ids=["qwen3_moe-ep2tp2", "qwen2_moe-ep2tp2", "qwen3_moe-pp2", "qwen3_moe-cp2"])
def test_replay_equals_the_engine_across_layouts(tmp_path, family, layout):
    world, layout_kw, micro_kw = layout
    hf_dir = make_tied_moe(family, str(tmp_path / family))
    per_rank = run_distributed(engine_vs_trainer, world, hf_dir, tie_prompts(), layout_kw, micro_kw, timeout=400)
    routes = tokens = total = 0
    for out in per_rank:
        m = out["mask"].bool()
        assert (out["replayed"] - out["engine"]).abs()[m].max().item() <= 1e-5
        assert (out["r2"] - out["free"]).abs()[m].max().item() <= 1e-6  # R2: its own recorded routes replayed
    for out in per_rank[::2] if world == 4 else per_rank[:1]:  # one rank per data-parallel share (its peers agree)
        r, t, n = route_differences(out)
        routes, tokens, total = routes + r, tokens + t, total + n
    agree, total = sum(o["agree"] for o in per_rank), sum(o["total"] for o in per_rank)
    assert total == sum(route_differences(o)[2] for o in (per_rank[::2] if world == 4 else per_rank[:1])) \
        and agree < total  # every valid route counted once over the ranks
    free = max((o["free"] - o["engine"]).abs()[o["mask"].bool()].max().item() for o in per_rank)
    print(f"{family} {layout_kw}: free {free:.2e}; {routes}/{total} routes on {tokens} tokens differ")
    assert free > 1e-3 and 3 <= routes < total // 4  # near-ties flip a few routes; a partial record would flip many


@pytest.mark.long
def test_activation_recompute_replays_each_micro_batch_in_the_backward(tmp_path):
    """PP2 with four micro-batches (1F1B: a forward runs ahead of the first backward) under replay: the gradients
    with full activation recompute equal those without (the recomputed forwards replay their own routes)."""
    hf_dir = make_tied_moe("qwen3_moe", str(tmp_path / "m"))
    plain, recomputed = run_distributed(replay_grads, 2, hf_dir, tie_prompts(), {"pp": 2}, {"micro_batch_size": 1},
                                        timeout=400)[0]
    assert plain.keys() == recomputed.keys() and plain
    for name, g in plain.items():
        torch.testing.assert_close(recomputed[name], g, rtol=1e-5, atol=1e-7, msg=name)
