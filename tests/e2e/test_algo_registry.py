"""Every registered advantage estimator and policy loss mode trains a one-step tiny run from the config alone,
and a user's estimator and loss register from a file (recipes/custom_algos.py, docs/algorithms.md's example)."""
from __future__ import annotations

import math

import pytest

from megappo.algos.estimators import ADV_ESTIMATORS
from megappo.algos.policy_losses import POLICY_LOSSES
from megappo.config import load_config
from megappo.testing.prompts import read_metrics, tiny_run_overrides, write_prompt_parquet
from megappo.trainer import fit

pytestmark = pytest.mark.e2e
BUILTIN_ESTIMATORS = ["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "opo",
                      "gpg", "grpo_passk", "grpo_vectorized", "rloo_vectorized", "optimal_token_baseline",
                      "tir_optimal_token_baseline"]
# gdpo needs reward components: test_gdpo_trains_on_the_reward_functions_components
BUILTIN_LOSSES = ["vanilla", "gspo", "cispo", "sapo", "clip_cov", "kl_cov", "geo_mean", "gpg", "dppo_tv", "dppo_kl",
                  "dro"]
SMALL = ["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4",
         "actor_rollout_ref.rollout.n=2", "trainer.val_before_train=false", "trainer.save_freq=-1",
         "data.max_response_length=4"]


@pytest.fixture(scope="module")
def data(tmp_path_factory, hf_model_dir):
    d = tmp_path_factory.mktemp("algo_data")
    return {"model": hf_model_dir("qwen2"), "train": write_prompt_parquet(str(d / "train.parquet"), 8)}


def _run(data, out, *extra, steps: int = 1) -> dict:
    cfg = load_config("gsm8k/tiny_cpu", tiny_run_overrides(str(out), data["model"], data["train"], steps=steps,
                                                           extra=[*SMALL, *extra]))
    assert fit(cfg) == 0
    rows = read_metrics(str(out))
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
    return rows[-1]


def test_every_name_is_tested():
    assert set(BUILTIN_ESTIMATORS) <= set(ADV_ESTIMATORS)
    assert set(BUILTIN_LOSSES) <= set(POLICY_LOSSES)


@pytest.mark.parametrize("name", BUILTIN_ESTIMATORS)
def test_estimator_trains(data, tmp_path, name):
    row = _run(data, tmp_path / name, f"algorithm.adv_estimator={name}")
    assert ("critic/vf_loss" in row) == (name == "gae")
    assert ("reward/greedy_baseline_mean" in row) == (name == "remax")


@pytest.mark.parametrize("mode", BUILTIN_LOSSES)
def test_policy_loss_trains(data, tmp_path, mode):
    agg = "seq-mean-token-sum-norm" if mode == "gpg" else "seq-mean-token-mean"
    row = _run(data, tmp_path / mode, "algorithm.adv_estimator=grpo",
               f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}", f"actor_rollout_ref.actor.loss_agg_mode={agg}",
               *(["actor_rollout_ref.actor.policy_loss.dro_beta=0.1"] if mode == "dro" else []))
    assert "actor/pg_loss" in row and "actor/ppo_kl" in row


def test_custom_estimator_and_loss_from_a_file(data, tmp_path):
    path = "recipes/custom_algos.py"
    row = _run(data, tmp_path / "custom", "algorithm.adv_estimator=median_baseline",
               f"algorithm.custom_adv_estimator.path={path}", "algorithm.custom_adv_estimator.name=median_baseline",
               "actor_rollout_ref.actor.policy_loss.loss_mode=clipped_pg",
               f"actor_rollout_ref.actor.policy_loss.path={path}", "actor_rollout_ref.actor.policy_loss.name=clipped_pg")
    assert "critic/vf_loss" not in row and "actor/pg_loss" in row


def test_gdpo_trains_on_the_reward_functions_components(data, tmp_path):
    """gdpo reads algorithm.gdpo_reward_keys from the dict the reward function returns."""
    reward = tmp_path / "components.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    fmt = float(len(solution_str) % 2)\n"
                      "    acc = float(len(solution_str) % 3 == 0)\n"
                      "    return {'score': fmt + acc, 'format_reward': fmt, 'accuracy_reward': acc}\n")
    row = _run(data, tmp_path / "gdpo", "algorithm.adv_estimator=gdpo", f"custom_reward_function.path={reward}",
               "algorithm.gdpo_reward_keys=[format_reward,accuracy_reward]", "algorithm.gdpo_reward_weights=[1,2]")
    assert "actor/pg_loss" in row and "critic/vf_loss" not in row


@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_optimal_token_baseline_gets_the_old_policys_sum_pi_squared(data, tmp_path, monkeypatch, name):
    """Two steps; the first step's sum_v pi^2, fed to the estimator, equals transformers' softmax(logits / T)^2
    summed over the vocabulary at each response token (the old policy of step 1 is the initial model), and the
    step's advantages are the estimator's on those numbers."""
    import torch
    import transformers

    from megappo.algos import estimators
    from megappo.trainer import phases

    seen = []
    original = phases._token_baseline_advantages

    def spy(run, exp, spec, p):
        adv, ret = original(run, exp, spec, p)
        seen.append((exp, run.sampling.logprob_temperature, adv))
        return adv, ret

    monkeypatch.setattr(phases, "_token_baseline_advantages", spy)
    _run(data, tmp_path / name, f"algorithm.adv_estimator={name}", steps=2)
    assert len(seen) == 2
    exp, temperature, adv = seen[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(data["model"], torch_dtype=torch.float32).eval()
    b, big_p = exp.batch, exp.batch.prompt_len
    want = torch.zeros_like(exp.sum_pi_squared)
    for i, (pl, rl) in enumerate(zip(b.prompt_lengths().tolist(), exp.response_lengths().tolist())):
        ids = b.input_ids[i, big_p - pl: big_p + rl].unsqueeze(0)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, pl - 1: pl + rl - 1].float() / temperature
        want[i, :rl] = torch.softmax(logits, -1).pow(2).sum(-1)
    want *= exp.mask
    assert exp.mask.sum() > 0 and (want[exp.mask.bool()] > 0).all()
    torch.testing.assert_close(exp.sum_pi_squared, want, rtol=1e-4, atol=1e-6)
    t = exp.train
    ref, _ = estimators.compute_advantages(
        estimators.get_adv_estimator(name), exp.token_rewards, exp.mask,
        estimators.EstimatorParams(gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True, gdpo_reward_weights=None),
        group_ids=exp.uids, old_log_probs=t.old_log_probs, sum_pi_squared=want, is_weights=t.rollout_is_weights)
    torch.testing.assert_close(adv, ref, rtol=1e-4, atol=1e-5)
