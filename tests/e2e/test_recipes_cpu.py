"""The CPU recipes as a user runs them: `megappo train --config recipes/cpu/...` in a fresh process, with a HOME
that holds nothing, and the run must visibly learn (the mean reward of the last five steps >= 0.3 above that of the
first five, each step counted once: a step the KL guard retried by its retry), log everything, checkpoint and export
the actor."""
from __future__ import annotations


import pytest

from megappo.testing import golden
from megappo.testing.recipes import learned, run_recipe
from megappo.trainer.metrics import read_rows

pytestmark = pytest.mark.e2e


def test_main_job_learns_and_repeats_its_golden_metrics(tmp_path):
    """The main job learns, and logs exactly its golden metrics (tests/golden/tiny_ppo.jsonl, megappo/testing/golden.py):
    a change that moves a number fails here, unless it records the golden again in a commit that says why."""
    out = tmp_path / "tiny_ppo"
    rows = run_recipe("recipes/cpu/tiny_ppo.yaml", out, env=golden.GOLDEN_ENV)
    assert [r["step"] for r in read_rows(str(out))] == list(range(21))  # no step rolled back
    gain = learned(rows)
    assert gain >= 0.3, [r.get("reward/mean") for r in rows]
    val = [r["val/megappo/digit_max/reward_mean"] for r in rows if "val/megappo/digit_max/reward_mean" in r]
    assert len(val) == 3 and val[-1] >= val[0] + 0.3  # before training, at step 10 and at the last step
    assert (out / "tensorboard").is_dir() and (out / "synthetic" / "digit_max" / "model" / "config.json").is_file()
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "20"
    assert (out / "hf" / "actor" / "config.json").is_file()
    header, want = golden.read("tiny_ppo")
    diff = golden.differences(golden.strip_machine_keys(read_rows(str(out))), want)
    if diff and header["cpu"] != golden.cpu_signature():
        pytest.skip(f"the golden was recorded on {header['cpu']!r}, whose floats differ from this CPU's "
                    f"({golden.cpu_signature()!r}) even under GOLDEN_ENV: {diff[:2]}")
    assert not diff, "\n".join(diff)


# tiny_ppo_one_step_off is tiny_ppo_async's schedule with W = 1 (tests/e2e/test_fully_async.py): the long tier
@pytest.mark.parametrize("recipe", ["tiny_ppo_kl_loss", "tiny_grpo",
                                    pytest.param("tiny_ppo_one_step_off", marks=pytest.mark.long), "tiny_ppo_async",
                                    "tiny_gspo", "tiny_rloo", "tiny_reinforce_pp", "tiny_dapo",
                                    "tiny_grpo_top_entropy"])
def test_cpu_variants_learn(tmp_path, recipe):
    rows = run_recipe(f"recipes/cpu/{recipe}.yaml", tmp_path / recipe)  # with its checkpoints: the guard can roll back
    # dynamic sampling trains on groups that hold right and wrong answers: its reward/mean is not the policy's
    key = "filter_groups/reward_mean_all" if recipe == "tiny_dapo" else "reward/mean"
    assert learned(rows, key) >= 0.3, [r.get(key) for r in rows]
    if recipe == "tiny_dapo":
        steps = rows[1:]
        assert all(r["filter_groups/num_dropped_groups"] > 0 for r in steps)
        assert max(r["train/num_gen_batches"] for r in steps) > 1
        assert any(r["reward/overlong_fraction"] > 0 for r in steps)
        assert not any(k.startswith(("critic/", "kl/mean")) or k == "actor/kl_loss" for k in rows[1])
    elif recipe == "tiny_grpo_top_entropy":  # the policy gradient saw a fifth of the tokens, every step
        assert all(0.2 <= r["actor/selected_token_fraction"] < 0.3 for r in rows[1:])
        assert rows[-1]["actor/entropy_threshold"] < rows[1]["actor/entropy_threshold"]  # the policy grew sure
    elif recipe in ("tiny_grpo", "tiny_gspo", "tiny_rloo", "tiny_reinforce_pp"):
        assert not any(k.startswith("critic/") for k in rows[1])
    elif recipe == "tiny_ppo_one_step_off":
        assert [r["async/staleness_max"] for r in rows[1:3]] == [0.0, 1.0]
    elif recipe == "tiny_ppo_async":
        assert max(r["async/staleness_max"] for r in rows[1:]) <= 1.0
        assert [r["step"] for r in rows if "rollout/weight_version" in r] == list(range(2, 21, 2))
    else:
        assert rows[-1]["actor/kl_loss"] > 0


# the trainer at TP2 x PP2 against one rank is tests/multirank/test_trainer_layouts.py's default-tier
# test_tp2_pp2_on_four_ranks_matches_one_rank; this one adds the recipe file under torchrun: the long tier
@pytest.mark.multirank
@pytest.mark.long
def test_tp2_pp2_recipe_repeats_the_one_rank_run(tmp_path):
    """Four gloo ranks at TP2 x PP2 sample and learn exactly what one rank does (same seeds, same metrics)."""
    steps = ["trainer.total_training_steps=4", "trainer.test_freq=-1", "trainer.save_freq=-1"]
    four = run_recipe("recipes/cpu/tiny_ppo_tp2pp2.yaml", tmp_path / "tp", *steps, nproc=4)
    one = run_recipe("recipes/cpu/tiny_ppo.yaml", tmp_path / "one", *steps)
    for a, b in zip(one[1:], four[1:]):
        assert b["reward/mean"] == a["reward/mean"]
        for key in ("actor/pg_loss", "critic/vf_loss", "kl/mean", "actor/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-5), key
