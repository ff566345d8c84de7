"""End-to-end PPO runs of a tiny model on one CPU rank: what a user sees (metrics, checkpoints, the exported
actor) and the trainer's invariants (on-policy sanity, micro-batch invariance, rollout vs trainer log-probs)."""
from __future__ import annotations

import glob
import math
import os

import pytest
import torch

from megappo.config import load_config
from megappo.testing.prompts import read_metrics, tiny_run_overrides, write_prompt_parquet
from megappo.trainer import fit

pytestmark = pytest.mark.e2e

RECIPE = "gsm8k/tiny_cpu"
REQUIRED = [
    "reward/mean", "reward/std", "response/length_mean", "response/clip_ratio", "actor/pg_loss",
    "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "actor/lr",
    "critic/vf_loss", "critic/vf_clipfrac", "critic/vf_explained_var", "critic/grad_norm", "kl/mean", "kl/coef",
    "rollout/logprob_diff_mean", "rollout/logprob_diff_max", "timing/rollout_s", "timing/update_actor_s",
    "timing/weight_sync_s", "timing/step_s", "perf/tokens_per_s",
]
# one mini-batch per step: the first (and only) update of a step starts exactly on-policy
ONE_MINI_BATCH = ["actor_rollout_ref.actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4"]


@pytest.fixture(scope="module")
def data(tmp_path_factory, hf_model_dir):
    d = tmp_path_factory.mktemp("trainer_data")
    return {"model": hf_model_dir("qwen2"), "train": write_prompt_parquet(str(d / "train.parquet"), 32),
            "val": write_prompt_parquet(str(d / "val.parquet"), 6, seed=1)}


def _run(data, out, steps=1, extra=(), val=False) -> list[dict]:
    cfg = load_config(RECIPE, tiny_run_overrides(str(out), data["model"], data["train"],
                                                 val_file=data["val"] if val else None, steps=steps,
                                                 extra=list(extra)))
    assert fit(cfg) == 0
    return read_metrics(str(out))


def _safetensors(directory: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        out.update(load_file(f))
    return out


def test_ppo_run_logs_checkpoints_and_exports(data, tmp_path):
    out = tmp_path / "run"
    rows = _run(data, out, steps=2, val=True, extra=[
        *ONE_MINI_BATCH, "trainer.test_freq=2", "trainer.save_freq=2", "trainer.val_before_train=true",
        "trainer.logger=[console,tensorboard]", "reward_model.backend=process"])
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "val/openai/gsm8k/reward_mean" in rows[0] and "val/openai/gsm8k/reward_mean" in rows[2]
    for row in rows[1:]:
        missing = [k for k in REQUIRED if k not in row]
        assert not missing, f"step {row['step']} lacks {missing}"
        assert all(v is None or math.isfinite(v) for k, v in row.items())
        assert row["response/length_mean"] > 0 and 0 <= row["response/clip_ratio"] <= 1
        assert row["rollout/logprob_diff_mean"] <= 1e-3
    first = rows[1]
    # on-policy sanity: the first update of a step sees ratio 1 everywhere
    assert first["actor/ppo_kl"] < 1e-6 and first["actor/pg_clipfrac"] == 0
    assert first["kl/mean"] == 0  # actor == reference before the first update
    assert rows[2]["kl/mean"] != 0 and rows[2]["rollout/weight_version"] == 2

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("actor/pg_loss")] == [1, 2]
    assert acc.Scalars("reward/mean")[1].value == pytest.approx(rows[2]["reward/mean"])

    ckpt = out / "checkpoints"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert (ckpt / "global_step_2" / "actor" / "megappo_checkpoint.json").is_file()
    assert (ckpt / "global_step_2" / "critic" / "megappo_checkpoint.json").is_file()

    # the exported actor loads in transformers and is the trained policy, not the initial one
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(out / "hf" / "actor"))
    assert model is not None
    trained, initial = _safetensors(str(out / "hf" / "actor")), _safetensors(data["model"])
    assert trained.keys() == initial.keys()
    assert max((trained[k] - initial[k]).abs().max().item() for k in trained) > 1e-6


def test_micro_batch_invariance(data, tmp_path):
    """Micro-batch size and token-budget packing change nothing: losses, gradient norms, final weights."""
    variants = {
        "whole": ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null", "critic.ppo_micro_batch_size_per_gpu=null"],
        "one": ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "critic.ppo_micro_batch_size_per_gpu=1",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1"],
        "tokens": ["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=80",
                   "critic.use_dynamic_bsz=true", "critic.ppo_max_token_len_per_gpu=80"],
    }
    results = {name: (_run(data, tmp_path / name, extra=extra)[0], _safetensors(str(tmp_path / name / "hf" / "actor")))
               for name, extra in variants.items()}
    ref_row, ref_w = results["whole"]
    for name, (row, w) in results.items():
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "actor/entropy", "critic/vf_loss",
                    "critic/grad_norm", "rollout/logprob_diff_mean"):
            assert row[key] == pytest.approx(ref_row[key], rel=1e-4, abs=1e-6), f"{name}: {key}"
        assert max((w[k] - ref_w[k]).abs().max().item() for k in w) < 1e-5, name


def test_kl_loss_instead_of_kl_in_reward(data, tmp_path):
    rows = _run(data, tmp_path / "kl", steps=2, extra=[
        "algorithm.use_kl_in_reward=false", "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.kl_loss_coef=0.1"])
    assert rows[0]["actor/kl_loss"] >= 0 and rows[1]["actor/kl_loss"] > 0  # the actor moved off the reference
    assert rows[1]["kl/mean"] != 0


def test_grpo_run_has_no_critic(data, tmp_path):
    rows = _run(data, tmp_path / "grpo", steps=2, extra=[
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.use_kl_loss=true",
        "algorithm.use_kl_in_reward=false"])
    assert not any(k.startswith("critic/") or k == "timing/values_s" for k in rows[0])
    assert rows[0]["advantages/mean"] == pytest.approx(0.0, abs=1e-5)  # group-centred
    assert not (tmp_path / "grpo" / "checkpoints").exists()


def test_reward_model_run(data, tmp_path, hf_model_dir):
    rm = hf_model_dir("qwen2", seq_cls=True)
    rows = _run(data, tmp_path / "rm", steps=2, extra=[
        "reward_model.enable=true", f"reward_model.path={rm}", f"critic.model.path={rm}"])
    assert rows[0]["reward/std"] > 0  # learned scores, not a constant rule reward
    assert "reward/num_failed" not in rows[0]  # no rule reward ran


@pytest.mark.parametrize("sampling", [
    ["actor_rollout_ref.rollout.temperature=0"],
    ["actor_rollout_ref.rollout.temperature=0.7"],
    ["actor_rollout_ref.rollout.top_k=5"],
    ["actor_rollout_ref.rollout.top_p=0.8", "actor_rollout_ref.rollout.temperature=1.3"],
], ids=["greedy", "temperature", "top_k", "top_p"])
def test_rollout_and_trainer_log_probs_agree(data, tmp_path, sampling):
    rows = _run(data, tmp_path / "lp", extra=["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
                                                "algorithm.use_kl_in_reward=false", *sampling])
    assert rows[0]["rollout/logprob_diff_mean"] <= 1e-3


def test_a_finished_run_resumes_from_its_checkpoint(data, tmp_path):
    """resume_mode=auto (the default) continues from the newest complete checkpoint: no step is run twice."""
    out = tmp_path / "resume"
    _run(data, out, steps=2, extra=["trainer.save_freq=1"])
    rows = _run(data, out, steps=3, extra=["trainer.save_freq=1"])
    assert [r["step"] for r in rows] == [1, 2, 3]  # appended: steps 1 and 2 from the first run, 3 from the second
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "3"
    # the fresh engine got the restored weights as version 2 (as the engine had them), step 3's update made 3
    assert rows[2]["rollout/weight_version"] == 3
    assert rows[2]["rollout/logprob_diff_mean"] <= 1e-3  # ...so it sampled from the weights the trainer resumed


def test_verify_sync_checks_the_engine_holds_the_actor_weights(data, tmp_path, monkeypatch):
    """rollout.verify_sync compares the engine's log-probs of fixed tokens with the trainer's after each sync; an
    engine left with other weights stops the run."""
    rows = _run(data, tmp_path / "ok", steps=2, extra=["actor_rollout_ref.rollout.verify_sync=true"])
    assert all(r["rollout/verify_sync_max_diff"] <= 1e-3 for r in rows)
    assert all(r["perf/weight_sync_gbps"] > 0 for r in rows)

    from megappo.trainer.rollout import RolloutWorker

    real = RolloutWorker.sync_weights

    def stale_sync(self, chunks, hf_config, version):  # the engine keeps its weights, plus noise
        out = real(self, chunks, hf_config, version)
        with torch.no_grad():
            for p in self.engine.model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        return out

    monkeypatch.setattr(RolloutWorker, "sync_weights", stale_sync)
    with pytest.raises(RuntimeError, match="the rollout engine's log-probs differ from the trainer's"):
        _run(data, tmp_path / "bad", steps=1, extra=["actor_rollout_ref.rollout.verify_sync=true"])


def test_validation_in_a_step_that_stops_the_run_scores_the_updated_actor(data, tmp_path, monkeypatch):
    """rollout.free_cache_engine frees the in-process engine's weights from the rollout to the weight sync. A step
    after which the run stops skips its sync; validation before the save then refills the engine with the actor's
    weights, so the stopped run validates what the uninterrupted run does."""
    from megappo.trainer.preemption import EXIT_REQUEUE, StopRequest

    extra = ["trainer.test_freq=1", "trainer.val_before_train=false"]
    full = _run(data, tmp_path / "full", steps=2, extra=extra, val=True)
    monkeypatch.setattr(StopRequest, "reason", lambda self: "stop requested by the test")
    out = tmp_path / "stopped"
    cfg = load_config(RECIPE, tiny_run_overrides(str(out), data["model"], data["train"], val_file=data["val"],
                                                 steps=2, extra=extra))
    assert fit(cfg) == EXIT_REQUEUE
    (row,) = read_metrics(str(out))
    assert row["rollout/weight_sync_skipped"] == 1.0
    val = {k: v for k, v in full[0].items() if k.startswith("val/")}
    assert val and {k: row[k] for k in val} == val
