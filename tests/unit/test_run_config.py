"""A run directory keeps the configuration it was trained with; a finished run's directory given another one says
so (and that nothing was trained), a resume under another one names the keys; extending the run or changing when it
saves, validates or logs is not another configuration."""
from __future__ import annotations

from megappo.config import load_config
from megappo.trainer import run_config


def _text(*overrides: str) -> str:
    return run_config.snapshot(load_config("recipes/cpu/tiny_grpo.yaml", list(overrides)))


def test_only_keys_that_change_the_run_are_differences(tmp_path):
    run_config.record(str(tmp_path), _text(), resumed=False)
    assert (tmp_path / run_config.CONFIG_FILE).is_file()
    same = _text("trainer.total_training_steps=40", "trainer.save_freq=5", "trainer.logger=[]",
                 f"trainer.default_local_dir={tmp_path}", "trainer.test_freq=2", "trainer.experiment_name=x",
                 "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2")
    assert run_config.changes(str(tmp_path), same) == []
    assert run_config.changes(str(tmp_path), _text("algorithm.adv_estimator=rloo")) == [
        "algorithm.adv_estimator: 'grpo' -> 'rloo'"]
    assert run_config.changes(str(tmp_path / "elsewhere"), _text()) is None  # nothing stored: nothing to compare


def test_a_finished_runs_directory_given_another_configuration_warns(tmp_path, capsys):
    run_config.record(str(tmp_path), _text(), resumed=False)
    run_config.warn_finished(str(tmp_path), _text())
    assert capsys.readouterr().err == ""
    custom = _text("actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "actor_rollout_ref.actor.optim.lr=1e-4")
    run_config.warn_finished(str(tmp_path), custom)
    err = capsys.readouterr().err
    assert err.startswith(f"megappo train: WARNING: this configuration is not the one that finished in {tmp_path}")
    assert "actor_rollout_ref.actor.policy_loss.loss_mode: 'vanilla' -> 'gspo'" in err
    assert "it was not trained" in err and "trainer.default_local_dir" in err


def test_a_resume_under_another_configuration_names_it_and_stores_the_new_one(tmp_path, capsys):
    run_config.record(str(tmp_path), _text(), resumed=False)
    new = _text("actor_rollout_ref.actor.optim.lr=1e-4")
    run_config.record(str(tmp_path), new, resumed=True)
    err = capsys.readouterr().err
    assert "WARNING: resuming" in err and "actor_rollout_ref.actor.optim.lr: 0.002 -> 0.0001" in err
    assert (tmp_path / run_config.CONFIG_FILE).read_text() == new
    run_config.record(str(tmp_path), new, resumed=True)
    assert capsys.readouterr().err == ""
