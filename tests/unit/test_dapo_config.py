"""DAPO's settings (algorithm.filter_groups, data.gen_batch_size, reward_model.overlong_buffer), their rules, the
recipes, and the pure parts of megappo/trainer/dynamic_sampling.py."""
import math

import pytest

from megappo.config import load_config
from megappo.checks import rule_errors
from megappo.platform.exits import RunStopped
from megappo.trainer.dynamic_sampling import kept_groups, metric_values, overlong_penalties
from megappo.trainer.phases import RuleScores


def _errors(*overrides):
    return "\n".join(rule_errors(load_config("cpu/tiny_dapo", list(overrides)), 1, check_files=False))


def test_defaults_are_verls_and_change_nothing():
    cfg = load_config(None, ["actor_rollout_ref.model.path=/m"])
    fg, ob = cfg.algorithm.filter_groups, cfg.reward_model.overlong_buffer
    assert (fg.enable, fg.metric, fg.max_num_gen_batches) == (False, "reward", 0)
    assert (ob.enable, ob.len, ob.penalty_factor, ob.log) == (False, 0, 0.0, False)
    assert cfg.data.gen_batch_size == cfg.data.train_batch_size  # resolved


def test_rules_name_the_key_and_the_fix():
    assert _errors() == ""
    assert "algorithm.filter_groups.enable: needs groups to filter but actor_rollout_ref.rollout.n is 1" in \
        _errors("actor_rollout_ref.rollout.n=1", "algorithm.adv_estimator=gae", "critic.enable=true")
    for mode in ("one_step_off", "fully_async"):
        assert f"is not supported with async_training.mode={mode}" in \
            _errors(f"async_training.mode={mode}", "actor_rollout_ref.hybrid_engine=false")
    assert "set async_training.mode=sync" in _errors("async_training.mode=one_step_off")
    assert "data.gen_batch_size: is 48 but data.train_batch_size is 16" in \
        _errors("algorithm.filter_groups.enable=false")
    assert "seq_final_reward includes the in-reward KL" in \
        _errors("algorithm.filter_groups.metric=seq_final_reward", "algorithm.use_kl_in_reward=true")
    assert "reward_model.overlong_buffer.len: must be in (0, data.max_response_length=4]" in \
        _errors("reward_model.overlong_buffer.len=5")
    assert "reward_model.overlong_buffer.len: must be in (0" in _errors("reward_model.overlong_buffer.len=0")
    assert "penalty_factor: must be >= 0" in _errors("reward_model.overlong_buffer.penalty_factor=-1")
    both = _errors("reward_model.enable=true", "reward_model.path=/rm")
    assert "filters on rule rewards" in both and "shapes rule rewards" in both


def test_gpu_recipe_has_verls_dapo_values():
    cfg = load_config("dapo/qwen2.5-7b_dapo")
    d, a, r = cfg.data, cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    assert (d.train_batch_size, d.gen_batch_size, d.max_prompt_length, d.max_response_length) == (512, 1536, 2048,
                                                                                                  20480)
    assert d.train_files.endswith("dapo-math-17k.parquet") and d.val_files.endswith("aime-2024.parquet")
    assert (a.clip_ratio_low, a.clip_ratio_high, a.clip_ratio_c, a.loss_agg_mode) == (0.2, 0.28, 10.0, "token-mean")
    assert (a.optim.lr, a.optim.lr_warmup_steps, a.optim.weight_decay, a.ppo_mini_batch_size) == (1e-6, 10, 0.1, 32)
    assert not a.use_kl_loss and not cfg.algorithm.use_kl_in_reward and cfg.algorithm.adv_estimator == "grpo"
    assert (r.n, r.val_kwargs.n, r.val_kwargs.top_p) == (16, 32, 0.7)
    fg, ob = cfg.algorithm.filter_groups, cfg.reward_model.overlong_buffer
    assert (fg.enable, fg.metric, fg.max_num_gen_batches) == (True, "acc", 10)
    assert (ob.enable, ob.len, ob.penalty_factor) == (True, 4096, 1.0)


def test_overlong_penalty_is_verls():
    # verl: min(-(L - (max - len)) / len * factor, 0)
    assert overlong_penalties([100, 16384, 18432, 20480], 20480, 4096, 1.0) == [0.0, 0.0, -0.5, -1.0]
    assert overlong_penalties([3, 4], 4, 2, 0.5) == [-0.25, -0.5]


def test_kept_groups_drop_constant_ones():
    uids = [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    values = [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, -1.0, -1.0, -1.0, 5.0]
    assert kept_groups(uids, values) == [1, 3]  # a group of one is kept, as verl does
    assert kept_groups([0, 0, 1, 1], [math.nan, math.nan, math.nan, 1.0]) == [1]


def test_metric_values():
    scored = RuleScores([1.0, -1.0], {}, {"acc": [1.0, 0.0]})
    shaped = [0.5, -1.0]
    for name in ("reward", "seq_reward", "seq_final_reward"):
        assert metric_values(name, shaped, scored) == shaped
    assert metric_values("acc", shaped, scored) == [1.0, 0.0]
    assert metric_values("score", shaped, scored) == [1.0, -1.0]
    assert metric_values("acc", shaped, RuleScores([1.0, 0.0], {}, {})) == [1.0, 0.0]  # a float function's score
    with pytest.raises(RunStopped, match="metric='pred'.*returned: score, acc"):
        metric_values("pred", shaped, scored)
