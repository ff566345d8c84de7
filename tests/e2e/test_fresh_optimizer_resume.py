"""Every checkpoint the trainer writes loads, whatever its optimizer holds, and a run resumed or rolled back from it
continues bit for bit as the uninterrupted run did.

The checkpoints written before an optimizer's first update hold no Adam state (torch creates it on the first step),
which megatron could not load back: the KL guard's step-0 checkpoint, a save after updates that were all skipped
(a NaN gradient), the actor saved during `trainer.critic_warmup`; under the distributed optimizer too. Each is
resumed after a crash in the next step (in process: the crash is an exception out of the step, the same command is
fit() again), or rolled back to by the KL guard with scale factors of 1 (so the retried step must equal the
uninterrupted one). The 4-rank TP2 x PP2 variant is in tests/multirank/test_fresh_optimizer_layouts.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megappo.config import load_config
from megappo.testing.faults import inject_fault
from megappo.testing.prompts import assert_same_rows, read_metrics, tiny_run_overrides, write_prompt_parquet
from megappo.trainer import fit, phases

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
STEPS = 3
UNIT_FACTORS = ["trainer.guard.lr_factor=1", "trainer.guard.kl_coef_factor=1", "trainer.guard.clip_ratio_factor=1"]


@pytest.fixture(scope="module")
def data(tmp_path_factory, hf_model_dir):
    d = tmp_path_factory.mktemp("fresh_data")
    return {"model": hf_model_dir("qwen2"), "train": write_prompt_parquet(str(d / "train.parquet"), 32)}


def _cfg(data, out: Path, extra=()):
    return load_config("gsm8k/tiny_cpu", tiny_run_overrides(
        str(out), data["model"], data["train"], steps=STEPS,
        extra=["actor_rollout_ref.actor.optim.lr=1e-3", "critic.optim.lr=1e-3", *extra]))


def _crash_in_step(monkeypatch, step: int) -> None:
    """The process dies (an exception out of fit) in the middle of `step`, after its rollout."""
    real, calls = phases.make_experience, []

    def make_experience(*args, **kwargs):
        calls.append(1)
        if len(calls) == step:
            raise RuntimeError(f"killed in step {step}")
        return real(*args, **kwargs)
    monkeypatch.setattr(phases, "make_experience", make_experience)


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _same_run(ref: Path, out: Path, rows_of_out=None) -> None:
    assert_same_rows(read_metrics(str(ref)), rows_of_out or read_metrics(str(out)), ignore=("guard/",))
    a, b = _weights(ref / "hf" / "actor"), _weights(out / "hf" / "actor")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _marker(out: Path, step: int, role: str) -> dict:
    return json.loads((out / "checkpoints" / f"global_step_{step}" / role / "megappo_checkpoint.json").read_text())


# case: (overrides, step of the checkpoint with a fresh optimizer, its fresh roles, step that crashes, NaN at step)
CASES = {
    "step0": (["trainer.save_freq=10"], 0, ["actor", "critic"], 1, None),
    "step0_distributed_optimizer": (["trainer.save_freq=10",
                                     "actor_rollout_ref.actor.megatron.use_distributed_optimizer=true"],
                                    0, ["actor", "critic"], 2, None),
    "after_skipped_update": (["trainer.guard.enable=false", "trainer.save_freq=1"], 1, ["actor"], 2, 1),
    "critic_warmup": (["trainer.critic_warmup=2", "trainer.save_freq=2"], 2, ["actor"], 3, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_run_resumed_from_a_checkpoint_of_a_fresh_optimizer_continues_exactly(case, data, tmp_path, monkeypatch):
    extra, fresh_step, fresh_roles, crash_step, nan_step = CASES[case]
    if nan_step is not None:
        inject_fault(monkeypatch, "nan", nan_step)
    ref = tmp_path / "uninterrupted"
    assert fit(_cfg(data, ref, extra)) == 0
    if nan_step is not None:
        inject_fault(monkeypatch, "nan", nan_step)  # the interrupted run meets the same NaN

    out = tmp_path / "interrupted"
    with monkeypatch.context() as m:
        _crash_in_step(m, crash_step)
        with pytest.raises(RuntimeError, match=f"killed in step {crash_step}"):
            fit(_cfg(data, out, extra))
    assert int((out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text()) == fresh_step
    for role in ("actor", "critic"):
        assert _marker(out, fresh_step, role)["optimizer_state"] == ("fresh" if role in fresh_roles else "saved")
    assert fit(_cfg(data, out, extra)) == 0  # the same command again
    _same_run(ref, out)


def test_the_guard_rolls_a_first_step_back_to_step_0_and_retries_it_exactly(data, tmp_path, monkeypatch):
    """A NaN in step 1 trips the guard before any periodic checkpoint: the run returns to the step-0 checkpoint
    and, with scale factors of 1, the retried step 1 is the uninterrupted run's step 1."""
    extra = ["trainer.save_freq=10", *UNIT_FACTORS]
    ref = tmp_path / "uninterrupted"
    assert fit(_cfg(data, ref, extra)) == 0
    inject_fault(monkeypatch, "nan", 1)
    out = tmp_path / "rolled_back"
    assert fit(_cfg(data, out, extra)) == 0
    rows = read_metrics(str(out))
    assert [r["step"] for r in rows] == [1, 1, 2, 3]
    assert rows[0]["guard/rolled_back"] == 1.0 and rows[0]["actor/update_skipped"] > 0
    assert rows[1]["guard/rollbacks"] == 1.0
    _same_run(ref, out, rows_of_out=rows[1:])


def test_the_guard_trips_at_step_1_and_stops_with_exit_3_after_its_retries(data, tmp_path, monkeypatch):
    """The issue's reproduction: a threshold no step can pass. Every retry returns to step 0 (it loads) and the run
    stops naming the step-0 checkpoint, instead of dying in megatron's loader."""
    from megappo.platform.exits import RunStopped

    out = tmp_path / "strict"
    with pytest.raises(RunStopped, match="still after 2 rollbacks") as e:
        fit(_cfg(data, out, ["trainer.save_freq=10", "trainer.guard.kl_threshold=1e-12",
                             "trainer.guard.max_retries=2"]))
    assert str(out / "checkpoints" / "global_step_0") in str(e.value)
    assert [r["step"] for r in read_metrics(str(out))] == [1, 1, 1]
    assert json.loads((out / "run_status.json").read_text())["status"] == "stopped"
