"""The vision-language CPU recipe (recipes/cpu/tiny_vlm_ppo.yaml) as a user runs it: a tiny Qwen2.5-VL on the
colour_square image task, images through the data loader, the HF engine and the trainer's actor, reference and
critic (a VLM with a value head).

- `test_vlm_pipeline_runs` (default tier, ~8 s): three steps from a random model with the vision tower trained
  (actor.freeze_vision_tower=false): every step's metrics are there, the engine's log-probs equal the trainer's
  (rollout/logprob_diff_mean, and rollout.verify_sync after each sync) and each sync sends the whole model, tower
  included.
- `test_vlm_guard_rolls_a_spiked_step_back_and_the_engine_follows` (default tier, ~8 s): the KL guard's rollback
  with images, a trained tower and the released in-process engine.
- `test_vlm_recipe_learns_and_resumes` (default tier, ~40 s): the recipe as shipped learns (mean reward of the
  last five steps >= 0.3 above the first five), each sync sends only the language model (the tower is frozen), it
  checkpoints and exports the actor, and a run resumed from the step-10 checkpoint repeats steps 11.. of the
  uninterrupted run exactly (CPU, one thread: deterministic).
- `test_vlm_fully_async_resumes_its_queued_images` (`long`): fully_async with the engine in its own process; a
  checkpoint's generated, not yet trained batch keeps its images, and the resumed run trains on it exactly.
- `test_vlm_tp2_pp2_and_dp2_repeat_the_one_rank_run` (`multirank`, `long`): 4 gloo ranks at TP2 x PP2, and 2 at
  DP2 with token-budget micro-batches and packing, give the one-rank run's metrics, weight sync verified.
"""
from __future__ import annotations

import shutil

import pytest

from megappo.testing.prompts import assert_same_rows
from megappo.testing.recipes import learned, run_recipe

pytestmark = pytest.mark.e2e
RECIPE = "recipes/cpu/tiny_vlm_ppo.yaml"


def _hf_bytes(model_dir, vision: bool) -> int:
    """Bytes of the exported actor's language model (and its vision tower too when `vision`)."""
    from safetensors.torch import load_file

    total = 0
    for f in model_dir.glob("*.safetensors"):
        total += sum(t.numel() * t.element_size() for k, t in load_file(str(f)).items() if vision or "visual" not in k)
    return total


def _check_sync(rows, steps):
    trained = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in trained] == steps
    for r in trained:
        for key in ("reward/mean", "actor/pg_loss", "critic/vf_loss", "kl/mean", "rollout/weight_sync_bytes"):
            assert key in r, key
        # the engine sampled with the weights the trainer scores with, images included
        assert r["rollout/logprob_diff_mean"] < 1e-5 and r["rollout/logprob_diff_max"] < 1e-4, r
    return trained


def test_vlm_pipeline_runs(tmp_path):
    out = tmp_path / "vlm"
    rows = run_recipe(RECIPE, out, "trainer.total_training_steps=3", "trainer.test_freq=-1",
                      "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.logger=[]",
                      "data.synthetic.warm_start_steps=0", "data.synthetic.num_train_prompts=48",
                      "data.synthetic.num_val_prompts=8", "data.train_batch_size=16",
                      "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                      "actor_rollout_ref.actor.freeze_vision_tower=false",
                      "actor_rollout_ref.rollout.verify_sync=true", timeout=300)
    trained = _check_sync(rows, [1, 2, 3])
    full = _hf_bytes(out / "hf" / "actor", vision=True)
    assert all(r["rollout/weight_sync_bytes"] == full for r in trained)  # the trained tower is synced too
    assert all(r["rollout/verify_sync_max_diff"] < 1e-4 for r in trained)
    _loads_with_its_processor(out / "hf" / "actor", out / "synthetic" / "colour_square" / "model")


def _loads_with_its_processor(exported, base):
    """The export loads as the base did: its image processor and tokenizer give the base's inputs, and
    AutoProcessor (which also builds Qwen2-VL's video processor, so needs torchvision) loads it where it can."""
    import importlib.util

    import numpy as np
    from transformers import AutoImageProcessor, AutoTokenizer

    for name in ("preprocessor_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (exported / name).is_file(), name
    image = np.random.default_rng(0).integers(0, 255, (56, 84, 3), dtype=np.uint8)
    got, want = (AutoImageProcessor.from_pretrained(str(d))(images=[image], return_tensors="pt")
                 for d in (exported, base))
    assert got.keys() == want.keys() and all((got[k] == want[k]).all() for k in want)
    text = "<|vision_start|><|image_pad|><|vision_end|> which colour?"
    assert (AutoTokenizer.from_pretrained(str(exported))(text)["input_ids"]
            == AutoTokenizer.from_pretrained(str(base))(text)["input_ids"])
    if importlib.util.find_spec("torchvision") is not None:
        from transformers import AutoProcessor

        got, want = (AutoProcessor.from_pretrained(str(d))(text=[text], images=[image], return_tensors="pt")
                     for d in (exported, base))
        assert got.keys() == want.keys() and all((got[k] == want[k]).all() for k in want)


def test_vlm_guard_rolls_a_spiked_step_back_and_the_engine_follows(tmp_path, monkeypatch):
    """The KL guard with images and a trained tower: step 2's actor update is spiked (100000x the learning rate), the
    guard restores the step-1 checkpoint and retries it; the released in-process engine is refilled from the
    restored actor (its log-probs equal the trainer's again on the retried step and after)."""
    from megappo.config import load_config
    from megappo.testing.faults import inject_fault
    from megappo.testing.prompts import read_metrics
    from megappo.trainer import fit

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    seen = inject_fault(monkeypatch, "kl_spike", at_step=2)
    out = tmp_path / "guard"
    cfg = load_config(RECIPE, [f"trainer.default_local_dir={out}", "trainer.total_training_steps=3",
                               "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=1",
                               "trainer.logger=[]", "data.synthetic.warm_start_steps=0",
                               "data.synthetic.num_train_prompts=48", "data.synthetic.num_val_prompts=8",
                               "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                               "actor_rollout_ref.actor.freeze_vision_tower=false"])
    assert fit(cfg) == 0
    rows = [r for r in read_metrics(str(out)) if r["step"] > 0]
    assert seen == [1, 2, 2, 3] and [r["step"] for r in rows] == [1, 2, 2, 3]
    tripped, retried = rows[1], rows[2]
    assert tripped["guard/rolled_back"] == 1.0 and tripped["actor/ppo_kl"] > 0.2 >= retried["actor/ppo_kl"]
    assert retried["guard/rollbacks"] == 1.0
    assert all(r["rollout/logprob_diff_mean"] < 1e-5 for r in (retried, rows[3]))


def test_vlm_recipe_learns_and_resumes(tmp_path):
    out = tmp_path / "vlm"
    rows = run_recipe(RECIPE, out)
    trained = _check_sync(rows, list(range(1, 31)))
    assert learned(rows) >= 0.3, [r["reward/mean"] for r in trained]
    val = [r["val/megappo/colour_square/reward_mean"] for r in rows if "val/megappo/colour_square/reward_mean" in r]
    assert len(val) == 4 and val[-1] >= val[0] + 0.2, val  # before training and every 10 steps
    lm = _hf_bytes(out / "hf" / "actor", vision=False)
    assert lm < _hf_bytes(out / "hf" / "actor", vision=True)
    assert all(r["rollout/weight_sync_bytes"] == lm for r in trained)  # the frozen tower is not sent
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "30"

    again = tmp_path / "resumed"  # from the step-10 checkpoint, with the task's files reused
    again.mkdir()
    shutil.copytree(out / "synthetic", again / "synthetic")
    resumed = run_recipe(RECIPE, again, "trainer.resume_mode=resume_path",
                         f"trainer.resume_from_path={out / 'checkpoints' / 'global_step_10'}")
    assert_same_rows([r for r in rows if r["step"] > 10], [r for r in resumed if r["step"] > 10])


ASYNC = ("actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.engine_kwargs.threads=1",
         "async_training.mode=fully_async", "async_training.require_batches=2",
         "async_training.trigger_parameter_sync_step=2", "async_training.staleness_threshold=0.5",
         "async_training.partial_rollout=true", "trainer.total_training_steps=4", "trainer.save_freq=2",
         "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.logger=[]",
         "data.synthetic.num_train_prompts=256", "data.synthetic.num_val_prompts=8")


@pytest.mark.long
def test_vlm_fully_async_resumes_its_queued_images(tmp_path):
    """fully_async with the engine in its own process: the producer generates image prompts ahead, the step-2
    checkpoint keeps a generated, not yet trained batch (its images in trainer_state.json), and a run resumed from
    it trains on that batch exactly as the uninterrupted run did."""
    import json

    out = tmp_path / "async"
    rows = run_recipe(RECIPE, out, *ASYNC)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["rollout/logprob_diff_mean"] < 1e-5  # version 0 on both sides
    state = json.loads((out / "checkpoints" / "global_step_2" / "trainer_state.json").read_text())
    ready = state["rollout_queue"]["ready"]
    assert ready and all(m is not None and m["pixel_values"]["shape"][0] > 0 for m in ready[0]["multi_modal"])
    again = tmp_path / "resumed"
    again.mkdir()
    shutil.copytree(out / "synthetic", again / "synthetic")
    resumed = run_recipe(RECIPE, again, *ASYNC, "trainer.resume_mode=resume_path",
                         f"trainer.resume_from_path={out / 'checkpoints' / 'global_step_2'}")
    # the resumed run says the batches it generated again (async/restarted_samples): the engine's timing decides
    assert_same_rows([r for r in rows if r["step"] > 2], resumed,
                     ignore=("async/queue_size", "async/restarted_samples"))


@pytest.mark.multirank
@pytest.mark.long
def test_vlm_tp2_pp2_and_dp2_repeat_the_one_rank_run(tmp_path):
    """Four gloo ranks at TP2 x PP2 (the vision tower on the first stage, split over TP), and two data-parallel ones,
    sample and learn what one rank does, and the engine holds the actor's weights after each sync (verify_sync)."""
    layout = [f"{role}.megatron.{key}=2" for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")
              for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size")]
    steps = ["trainer.total_training_steps=3", "trainer.test_freq=-1", "trainer.val_before_train=false",
             "trainer.save_freq=-1", "trainer.logger=[]", "data.synthetic.num_train_prompts=128",
             "data.synthetic.num_val_prompts=8", "actor_rollout_ref.rollout.verify_sync=true"]
    one = run_recipe(RECIPE, tmp_path / "one", *steps)
    (tmp_path / "tp").mkdir()
    shutil.copytree(tmp_path / "one" / "synthetic", tmp_path / "tp" / "synthetic")
    four = run_recipe(RECIPE, tmp_path / "tp", *steps, *layout, "trainer.n_gpus_per_node=4", nproc=4)
    # DP2 with token-budget micro-batches and packing: each rank's rows keep their images through the split
    (tmp_path / "dp").mkdir()
    shutil.copytree(tmp_path / "one" / "synthetic", tmp_path / "dp" / "synthetic")
    two = run_recipe(RECIPE, tmp_path / "dp", *steps, "trainer.n_gpus_per_node=2",
                     "actor_rollout_ref.actor.use_dynamic_bsz=true",
                     "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=100",
                     "actor_rollout_ref.model.use_remove_padding=true", nproc=2)
    for other in (four, two):
        _check_sync(other, [1, 2, 3])
        for a, b in zip(one, other, strict=True):
            assert b["reward/mean"] == a["reward/mean"]
            for key in ("actor/pg_loss", "critic/vf_loss", "kl/mean", "actor/grad_norm"):
                assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-5), key
