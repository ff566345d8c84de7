"""The console's line per step (`megappo.trainer.metrics.console_line`, printed by `MetricsLogger`): the main
metrics, then each feature's own number when the step has it (environments, agent programs, failed episodes,
distillation, the judge, router replay), then the validation rewards; a run without a feature shows none of its
keys."""
from __future__ import annotations

from megappo.trainer.metrics import MetricsLogger, console_line

BASE = {"reward/mean": 0.25, "kl/mean": 0.001234567, "actor/pg_loss": -0.5, "critic/vf_loss": 0.125,
        "response/length_mean": 2.0, "timing/step_s": 1.5, "actor/grad_norm": 3.0, "tool/calls_per_sample": 0.5}


def test_a_plain_step_shows_the_main_metrics_only():
    assert console_line(3, BASE) == ("step 3: reward/mean=0.25 kl/mean=0.001235 actor/pg_loss=-0.5 "
                                     "critic/vf_loss=0.125 response/length_mean=2 timing/step_s=1.5")


def test_each_feature_shows_its_own_metric_when_the_step_has_it():
    agent = {"env/reward_mean": 0.5, "agent/calls_per_episode": 2.5, "agent/error_fraction": 0.0625,
             "agent/retokenized_fraction": 0.0, "episodes/failed_fraction": 0.0625}
    line = console_line(1, {**BASE, **agent})
    assert line.endswith("timing/step_s=1.5 env/reward_mean=0.5 agent/calls_per_episode=2.5 "
                         "agent/error_fraction=0.0625 episodes/failed_fraction=0.0625")
    assert "retokenized" not in line
    assert console_line(1, {**BASE, "distill/reverse_kl": 0.75, "distill/teacher_log_prob_mean": -1.0}).endswith(
        "timing/step_s=1.5 distill/reverse_kl=0.75")
    assert console_line(1, {**BASE, "actor/distill_loss": 0.5}).endswith("actor/distill_loss=0.5")
    judged = {**BASE, "reward/judge_unparsed_fraction": 0.125, "reward/judge_retries": 2.0,
              "reward/rule_score_mean": 0.75}
    assert console_line(1, judged).endswith("reward/judge_unparsed_fraction=0.125 reward/rule_score_mean=0.75")
    assert console_line(1, {**BASE, "rollout/router_agreement": 0.96875}).endswith("rollout/router_agreement=0.9688")


def test_hidden_keys_and_validation_rewards():
    step = {**BASE, "env/reward_mean": 0.0, "val/megappo/digit_max/reward_mean": 0.5, "val/other_metric": 1.0}
    assert console_line(10, step, hidden=("env/reward_mean",)).endswith(
        "timing/step_s=1.5 val/megappo/digit_max/reward_mean=0.5")
    assert console_line(10, step).endswith("timing/step_s=1.5 env/reward_mean=0 val/megappo/digit_max/reward_mean=0.5")


def test_the_logger_prints_the_line_on_the_console(tmp_path, capsys):
    log = MetricsLogger(str(tmp_path), ["console"], total_steps=2, enabled=True, hidden=("env/reward_mean",))
    log.log(1, {**BASE, "env/reward_mean": 0.0, "agent/calls_per_episode": 2.0})
    err = capsys.readouterr().err
    assert "step 1: reward/mean=0.25 " in err and "agent/calls_per_episode=2" in err and "env/" not in err


def test_the_tool_loop_hides_its_env_reward_and_environments_show_theirs():
    """tiny_tool_ppo's episodes log env/reward_mean 0 (the reward function rewards them); the environment's and
    the agent program's recipes reward their episodes themselves."""
    from megappo.config import load_config
    from megappo.trainer.build import _console_hidden

    assert _console_hidden(load_config("cpu/tiny_tool_ppo")) == ("env/reward_mean",)
    assert _console_hidden(load_config("cpu/tiny_env_ppo")) == ()
    assert _console_hidden(load_config("cpu/tiny_openai_agent_ppo")) == ()
