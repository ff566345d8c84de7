"""The KL guard and the reward watch in real runs of a tiny model: an injected NaN or KL spike is rolled back and
the run recovers and finishes; a spike that keeps coming stops the run with its last good checkpoint; the epoch
early stop skips PPO epochs; a reward function that keeps failing stops the run and is named.

Faults are injected around the real update phase (phases.update_actor): a NaN loss, or a learning rate 100000x the
configured one for that update."""
from __future__ import annotations

import json
import math

import pytest

from megappo.config import load_config
from megappo.platform.exits import RunStopped
from megappo.testing.prompts import read_metrics, tiny_run_overrides, write_prompt_parquet
from megappo.testing.faults import inject_fault
from megappo.trainer import fit
from megappo.trainer.metrics import read_steps

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def data(tmp_path_factory, hf_model_dir):
    d = tmp_path_factory.mktemp("guard_data")
    return {"model": hf_model_dir("qwen2"), "train": write_prompt_parquet(str(d / "train.parquet"), 32)}


def _cfg(data, out, steps, extra=()):
    return load_config("gsm8k/tiny_cpu", tiny_run_overrides(str(out), data["model"], data["train"], steps=steps,
                                                            extra=["trainer.save_freq=2", *extra]))


# kl_spike trips at step 4, two steps past the step-2 checkpoint: the rollback undoes the good step 3 as well
@pytest.mark.parametrize("fault,at", [("nan", 3), ("kl_spike", 4)])
def test_a_bad_step_is_rolled_back_and_the_run_recovers(data, tmp_path, monkeypatch, fault, at):
    seen = inject_fault(monkeypatch, fault, at_step=at)
    out = tmp_path / fault
    assert fit(_cfg(data, out, steps=4, extra=["trainer.logger=[tensorboard]"])) == 0
    rows = read_metrics(str(out))
    # step `at` tripped: back to the step-2 checkpoint, steps 3 and 4 then ran again with the scaled settings
    assert [r["step"] for r in rows] == seen == [1, 2, *range(3, at + 1), 3, 4]
    undone, tripped, retried = rows[2:at], rows[at - 1], rows[at]
    assert all(r["guard/rolled_back"] == 1.0 for r in undone)
    assert read_steps(str(out)) == rows[:2] + rows[at:] and not any("guard/rolled_back" in r for r in rows[at:])
    if fault == "nan":
        assert tripped["actor/update_skipped"] > 0  # the NaN gradient never reached the weights
    else:
        assert tripped["actor/ppo_kl"] > 0.2 >= retried["actor/ppo_kl"]
    assert retried["guard/rollbacks"] == 1.0 and retried["guard/lr_scale"] == 0.5
    assert retried["actor/lr"] == pytest.approx(0.5 * rows[1]["actor/lr"])
    assert retried["guard/kl_coef_scale"] == 5.0 and retried["kl/coef"] == pytest.approx(5 * rows[1]["kl/coef"])
    assert all(math.isfinite(r["actor/pg_loss"]) for r in rows[at:])
    state = json.loads((out / "checkpoints" / "global_step_4" / "trainer_state.json").read_text())
    assert state["guard"]["rollbacks"] == 1 and state["guard"]["clip_scale"] == 0.5  # survives a resume
    # TensorBoard: one point per step in the run's curves, the undone attempts in a run of their own
    kept = read_steps(str(out))
    assert _tb_points(out / "tensorboard", "reward/mean") == [(r["step"], r["reward/mean"]) for r in kept]
    assert _tb_points(out / "tensorboard" / "rolled_back", "reward/mean") == [(r["step"], r["reward/mean"])
                                                                              for r in undone]


def _tb_points(logdir, tag: str) -> list[tuple[int, float]]:
    """(step, value) of `tag` in the event files of `logdir`, as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return [(e.step, pytest.approx(e.value, rel=1e-6)) for e in acc.Scalars(tag)]


def test_a_spike_that_keeps_coming_stops_the_run_at_its_last_good_checkpoint(data, tmp_path, monkeypatch):
    seen = inject_fault(monkeypatch, "nan", at_step=3, times=99)
    out = tmp_path / "stops"
    with pytest.raises(RunStopped) as e:
        fit(_cfg(data, out, steps=4, extra=["trainer.guard.max_retries=2"]))
    assert seen == [1, 2, 3, 3, 3]  # the first try and two retries
    msg = str(e.value)
    assert "after 2 rollbacks" in msg and str(out / "checkpoints" / "global_step_2") in msg
    status = json.loads((out / "run_status.json").read_text())
    assert status["status"] == "stopped" and status["step"] == 2
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "2"


def test_without_checkpoints_a_tripped_step_stops_the_run(data, tmp_path, monkeypatch):
    inject_fault(monkeypatch, "nan", at_step=1)
    with pytest.raises(RunStopped, match="no checkpoint to roll back to: set trainer.save_freq"):
        fit(_cfg(data, tmp_path / "nock", steps=2, extra=["trainer.save_freq=-1"]))


def test_guard_off_keeps_training_through_a_nan(data, tmp_path, monkeypatch):
    inject_fault(monkeypatch, "nan", at_step=1)
    out = tmp_path / "off"
    assert fit(_cfg(data, out, steps=2, extra=["trainer.guard.enable=false"])) == 0
    rows = read_metrics(str(out))
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["actor/update_skipped"] > 0


def test_epoch_kl_stop_skips_the_remaining_epochs(data, tmp_path):
    out = tmp_path / "epochs"
    assert fit(_cfg(data, out, steps=1, extra=["actor_rollout_ref.actor.ppo_epochs=3",
                                                "trainer.guard.epoch_kl_stop=1e-12"])) == 0
    row = read_metrics(str(out))[0]
    assert row["guard/epochs_skipped"] == 2.0  # the first epoch's second mini-batch is already off-policy


def test_a_reward_function_that_keeps_failing_stops_the_run(data, tmp_path):
    bad = tmp_path / "bad_reward.py"
    bad.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                   "    raise ValueError('no answer parser for this format')\n")
    out = tmp_path / "reward"
    with pytest.raises(RunStopped) as e:
        fit(_cfg(data, out, steps=5, extra=[f"custom_reward_function.path={bad}",
                                            "reward_model.max_failure_steps=2"]))
    msg = str(e.value)
    assert f"{bad}:compute_score" in msg and "2 steps in a row" in msg and "no answer parser" in msg
    assert [r["step"] for r in read_metrics(str(out))] == [1]  # the second failing step was not trained on
