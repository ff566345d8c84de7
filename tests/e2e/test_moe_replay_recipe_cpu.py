"""recipes/cpu/tiny_moe_replay.yaml as a user runs it: GRPO on a tiny Qwen3-MoE policy whose routers start close to
ties (megappo.tasks.digit_max_moe), with router replay R3: it learns, logs the routers' agreement and the
engine-trainer log-prob gap every step, and repeats its golden metrics. The ties break at the first update (Adam's
steps are far larger than the ties' 1e-6), so step 1 is where replay has routes to correct."""
from __future__ import annotations

import pytest
import torch

from megappo.testing import golden
from megappo.testing.recipes import learned, run_recipe
from megappo.trainer.metrics import read_rows

pytestmark = pytest.mark.e2e
RECIPE = "recipes/cpu/tiny_moe_replay.yaml"


def test_moe_replay_recipe_learns_and_repeats_its_golden(tmp_path):
    out = tmp_path / "tiny_moe_replay"
    rows = run_recipe(RECIPE, out, env=golden.GOLDEN_ENV)
    assert learned(rows) >= 0.3, [r.get("reward/mean") for r in rows]
    steps = [r for r in rows if r["step"] > 0]
    assert steps[0]["rollout/router_agreement"] < 0.99  # the engine routed some tokens otherwise than the trainer
    assert all(0.0 < r["rollout/router_agreement"] <= 1.0 for r in steps)
    assert all(r["rollout/logprob_diff_max"] <= 1e-5 for r in steps)  # replayed: the engine's log-probs
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "12"
    header, want = golden.read("tiny_moe_replay")
    diff = golden.differences(golden.strip_machine_keys(read_rows(str(out))), want)
    if diff and header["cpu"] != golden.cpu_signature():
        pytest.skip(f"the golden was recorded on {header['cpu']!r}, whose floats differ from this CPU's: {diff[:2]}")
    assert not diff, "\n".join(diff)


# the default tier's test above runs the recipe with replay; this adds the same run without it (the gap compared)
@pytest.mark.long
def test_without_replay_the_first_steps_gap_is_large_and_r2_runs(tmp_path):
    short = ["trainer.total_training_steps=3", "trainer.test_freq=-1", "trainer.save_freq=-1",
             "trainer.val_before_train=false"]
    r3 = run_recipe(RECIPE, tmp_path / "r3", *short)
    free = run_recipe(RECIPE, tmp_path / "free", *short, "actor_rollout_ref.actor.megatron.router_replay.mode=disabled")
    assert all("rollout/router_agreement" not in b for b in free)
    assert r3[0]["rollout/logprob_diff_max"] <= 1e-5 < 1e-3 < free[0]["rollout/logprob_diff_max"]
    print(f"step 1 engine-trainer gap: R3 mean {r3[0]['rollout/logprob_diff_mean']:.2e} max "
          f"{r3[0]['rollout/logprob_diff_max']:.2e}; without replay mean {free[0]['rollout/logprob_diff_mean']:.2e} "
          f"max {free[0]['rollout/logprob_diff_max']:.2e}")
    r2 = run_recipe(RECIPE, tmp_path / "r2", *short, "actor_rollout_ref.actor.megatron.router_replay.mode=R2")
    assert r2[0]["reward/mean"] == r3[0]["reward/mean"]  # the same first samples; R2 replays its own routes
    assert "rollout/router_agreement" not in r2[0] and r2[-1]["reward/mean"] >= 0


# the default tier's recipe test covers replay in the trainer at one rank; this is the same run at EP2 (DP2)
@pytest.mark.long
@pytest.mark.multirank
def test_ep2_run_replays_as_one_rank_does(tmp_path):
    """Two ranks at EP2 (the experts split, each rank its data-parallel share of the samples and their routes) sample,
    replay and learn what one rank does: the same rewards, router agreement and log-prob gap, and the same losses
    up to float order (the ranks' gradients are summed in another order: within 2e-4 relative here). Each step is two
    optimizer steps, whose mini-batches hold the same samples at EP2 as at one rank (balanced within each)."""
    short = ["trainer.total_training_steps=3", "trainer.test_freq=-1", "trainer.save_freq=-1",
             "trainer.val_before_train=false"]
    one = run_recipe(RECIPE, tmp_path / "one", *short)
    two = run_recipe(RECIPE, tmp_path / "ep2", *short, "trainer.n_gpus_per_node=2",
                     "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2", nproc=2)
    assert [r["reward/mean"] for r in two] == [r["reward/mean"] for r in one]
    assert [r["response/length_mean"] for r in two] == [r["response/length_mean"] for r in one]
    for a, b in zip(one, two, strict=True):
        assert b["rollout/router_agreement"] == pytest.approx(a["rollout/router_agreement"])
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/ppo_kl", "actor/entropy", "actor/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-6), f"step {a['step']} {key}"
    assert two[0]["rollout/router_agreement"] < 0.99 and two[0]["rollout/logprob_diff_max"] <= 1e-5


# the default tier covers the routes' JSON form (tests/unit/test_router_replay.py); this is a real async run's
@pytest.mark.long
def test_async_queue_checkpoints_keep_the_routes_and_resume(tmp_path):
    """one_step_off: the batch generated ahead is saved with its routes (uint8 in base64) in trainer_state.json; a
    longer run resumes from the last checkpoint and replays them."""
    import json

    from megappo.models.router_replay import routes_from_json

    out = tmp_path / "async"
    args = ["async_training.mode=one_step_off", "actor_rollout_ref.hybrid_engine=false", "trainer.test_freq=-1",
            "trainer.save_freq=2", "trainer.val_before_train=false"]
    run_recipe(RECIPE, out, *args, "trainer.total_training_steps=4")  # step 2's checkpoint holds step 3's batch
    state = json.loads((out / "checkpoints" / "global_step_2" / "trainer_state.json").read_text())
    queued = state["rollout_queue"]["ready"][0]
    routes = [routes_from_json(r) for r in queued["routed_experts"]]
    for r, p, resp in zip(routes, queued["prompt_ids"], queued["response_ids"]):
        assert r.dtype == torch.uint8 and tuple(r.shape) == (len(p) + len(resp) - 1, 2, 2)
    rows = run_recipe(RECIPE, out, *args, "trainer.total_training_steps=5")
    assert rows[-1]["step"] == 5 and 0 < rows[-1]["rollout/router_agreement"] <= 1
