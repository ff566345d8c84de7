"""Failed episodes (megappo/envs/failures.py, the trainer's `failed_episodes`): found in the samples' stats, counted,
said once per agent and kind a minute with the first traceback in the run's log, a run whose episodes keep failing
stopped, and `rollout.agent.on_failure` applied: dropped episodes add nothing to the loss, their group's GRPO
statistics are made without them, and reward/* leaves them out."""
from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
import torch

from megappo.algos import estimators
from megappo.config import load_config
from megappo.envs.failures import FailureWatch, episode_failure, failure_metrics
from megappo.platform.watch import OncePerInterval
from megappo.trainer.dynamic_sampling import failed_episodes
from megappo.trainer.experience import Samples, build_experience


def program(error=0.0, timeout=0.0, no_calls=0.0, text=None, trace=None, name="guess"):
    return {"agent": {"error": error, "timeout": timeout, "no_calls": no_calls}, "agent_name": name,
            "error_text": text, "traceback": trace, "env_error": error, "env_timeout": timeout}


def env(error=0.0, timeout=0.0, text=None, name="game"):
    return {"env_error": error, "env_timeout": timeout, "agent_name": name, "error_text": text, "traceback": None}


def test_each_kind_of_failure_is_found_and_counted():
    stats = [program(), program(error=1.0), program(timeout=1.0), program(no_calls=1.0), env(), env(error=1.0),
             env(timeout=1.0), None]
    kinds = [episode_failure(s) for s in stats]
    assert kinds == [None, "agent_error", "agent_timeout", "agent_no_call", None, "env_error", "env_timeout", None]
    m = failure_metrics(kinds)
    assert m["episodes/failed_fraction"] == 5 / 8 and m["episodes/agent_error_fraction"] == 1 / 8
    assert set(m) == {"episodes/failed_fraction"} | {f"episodes/{k}_fraction" for k in kinds if k}
    assert failure_metrics([]) == {} and failure_metrics([None, None]) == {"episodes/failed_fraction": 0.0}


def test_failures_are_said_once_a_minute_with_a_count_and_the_first_traceback_logged(tmp_path):
    now = [0.0]
    out = io.StringIO()
    watch = FailureWatch(0.5, 3, "drop", log_dir=str(tmp_path), out=out,
                         warnings=OncePerInterval(60.0, clock=lambda: now[0]))
    boom = program(error=1.0, text="ValueError: boom\nmore", trace="Traceback ...\nValueError: boom\n")
    step = [boom, boom, program(), program()]
    for _ in range(2):  # the same failures again within the minute: nothing said
        assert watch.step(step, [episode_failure(s) for s in step]) is None
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("megappo train: WARNING: 2 of 4 episodes of agent 'guess' raised or returned "
                               "something other than a reward: ValueError: boom (left out of the loss")
    assert f"traceback in {tmp_path / 'episode_errors.log'}" in lines[0]
    now[0] = 61.0
    watch.step(step, [episode_failure(s) for s in step])
    assert "; 2 more since the last warning" in out.getvalue().splitlines()[1]
    log = (tmp_path / "episode_errors.log").read_text()
    assert log.count("=== agent 'guess': agent_error: ValueError: boom") == 1 and "Traceback ..." in log
    quiet = io.StringIO()
    FailureWatch(0.5, 3, "drop", out=quiet, speak=False).step(step, [episode_failure(s) for s in step])
    assert quiet.getvalue() == ""  # not rank 0


def test_a_run_whose_episodes_keep_failing_stops_and_a_good_step_breaks_the_streak():
    watch = FailureWatch(0.5, 2, "drop", out=io.StringIO())
    bad = [env(error=1.0, text="environment game: step raised KeyError: 'x'")] * 3 + [env()]
    good = [env()] * 4
    kinds = lambda stats: [episode_failure(s) for s in stats]  # noqa: E731
    assert watch.step(bad, kinds(bad)) is None
    assert watch.step(good, kinds(good)) is None  # the streak starts again
    assert watch.step(bad, kinds(bad)) is None
    reason = watch.step(bad, kinds(bad))
    assert "max_failure_fraction=0.5 of the episodes failed for 2 steps in a row" in reason
    assert "environment game: step raised KeyError: 'x'" in reason and "start the same command again" in reason
    never = FailureWatch(None, 1, "drop", out=io.StringIO())
    assert never.step(bad, kinds(bad)) is None


def samples(stats, scores_per_prompt=2):
    n = len(stats)
    return Samples(prompt_ids=[[1, 2]] * n, response_ids=[[3, 4, 5]] * n, rollout_log_probs=[[-1.0] * 3] * n,
                   truncated=[False] * n, uids=[i // scores_per_prompt for i in range(n)], data_sources=["d"] * n,
                   ground_truths=[None] * n, extra_infos=[{}] * n, weight_versions=[0] * n,
                   dataset_indices=list(range(n)), partial=[False] * n, loss_masks=[[1, 0, 1]] * n,
                   turn_stats=stats)


P = estimators.EstimatorParams(gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True, gdpo_reward_weights=None)


def run(on_failure):
    return SimpleNamespace(cfg=load_config(None, [f"actor_rollout_ref.rollout.agent.on_failure={on_failure}"]))


def test_dropped_episodes_train_nothing_and_their_groups_are_normalised_without_them():
    stats = [program(), program(error=1.0), program(), program(), program(), program(timeout=1.0),
             program(), program()]
    scores = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.5, 0.0]
    s, kept_scores = failed_episodes(run("drop"), samples(stats, 4), scores)
    assert kept_scores == scores and s.dropped == [False, True, False, False, False, True, False, False]
    assert s.loss_masks[1] == [0, 0, 0] and s.loss_masks[5] == [0, 0, 0] and s.loss_masks[0] == [1, 0, 1]
    assert s.uids[0] == s.uids[2] == s.uids[3] == 0 and len({s.uids[1], s.uids[5], 0, 1}) == 4
    exp = build_experience(s, range(len(s)), pad_token_id=0)
    assert exp.dropped.tolist() == s.dropped and exp.mask[1].sum() == 0
    adv = estimators.grpo(torch.tensor(scores), exp.uids, None, P)
    alone = estimators.grpo(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 0]), None,
                            P)
    assert torch.allclose(adv[[0, 2, 3]], alone)  # prompt 0's group is its three episodes that did not fail


@pytest.mark.parametrize("policy", ["zero_reward", "keep"])
def test_zero_reward_and_keep_train_on_failed_episodes(policy):
    stats = [program(), program(error=1.0)]
    s, scores = failed_episodes(run(policy), samples(stats), [1.0, 0.7])
    assert scores == ([1.0, 0.0] if policy == "zero_reward" else [1.0, 0.7])
    assert s.loss_masks == [[1, 0, 1]] * 2 and s.uids == [0, 0] and s.dropped == [None, None]


def test_a_step_without_failures_is_untouched():
    s0 = samples([program(), env()])
    s, scores = failed_episodes(run("drop"), s0, [1.0, 0.0])
    assert s is s0 and scores == [1.0, 0.0]


def test_zero_reward_with_a_reward_model_is_refused_by_name():
    from megappo.config.fields import ConfigError
    from megappo.checks import validate

    cfg = load_config(None, ["actor_rollout_ref.rollout.agent.on_failure=zero_reward", "reward_model.enable=true",
                             "reward_model.path=/m"])
    with pytest.raises(ConfigError, match="on_failure.*zero_reward scores failed episodes 0"):
        validate(cfg, check_files=False)


def test_an_agent_programs_reward_is_its_episodes_unless_the_rule_reward_is_asked_for():
    from megappo.trainer.dynamic_sampling import episode_rewards

    stats = [{**program(), "agent_reward": 0.25}, {**program(), "agent_reward": None}, env(), None]
    rule = [1.0, 1.0, 0.5, 0.0]
    assert episode_rewards(rule, stats, "agent") == [0.25, 1.0, 0.5, 0.0]
    assert episode_rewards(rule, stats, "rule") == rule
    assert load_config(None, []).actor_rollout_ref.rollout.agent.reward_source == "agent"


@pytest.mark.parametrize("policy", ["drop", "zero_reward", "keep"])
def test_every_policy_is_said_by_its_name(policy):
    out = io.StringIO()
    step = [program(error=1.0, text="ValueError: x"), program()]
    FailureWatch(0.9, 3, policy, out=out).step(step, [episode_failure(s) for s in step])
    assert f"on_failure={policy}" in out.getvalue()
