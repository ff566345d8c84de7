"""The pieces of a run that survives, on their own: which checkpoint a resume takes, what an interrupted save leaves
and who removes it, how many checkpoints are kept, RNG states round trip, the KL guard's decisions, the deadline."""
from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

from megappo.config.deadline import parse_deadline
from megappo.config.schema import GuardConfig
from megappo.models.checkpoint import CheckpointError
from megappo.platform.exits import RunStopped
from megappo.trainer import checkpointing as ck
from megappo.trainer.guard import KLGuard


def _ckpt(root, step, complete=True):
    d = root / "checkpoints" / f"global_step_{step}"
    d.mkdir(parents=True)
    if complete:
        (d / ck.STATE_FILE).write_text(json.dumps({"step": step}))
    return d


def test_auto_resume_takes_the_tracker_then_the_newest_complete(tmp_path):
    assert ck.find_resume_dir(str(tmp_path), "auto", None) is None  # nothing: a fresh start
    _ckpt(tmp_path, 2)
    _ckpt(tmp_path, 4)
    # killed between publishing global_step_4 and recording it: the newest complete one
    assert ck.find_resume_dir(str(tmp_path), "auto", None).endswith("global_step_4")
    (tmp_path / "checkpoints" / ck.TRACKER).write_text("2")
    assert ck.find_resume_dir(str(tmp_path), "auto", None).endswith("global_step_2")
    assert ck.find_resume_dir(str(tmp_path), "disable", None) is None


def test_auto_resume_with_checkpoints_but_none_complete_is_an_error(tmp_path):
    _ckpt(tmp_path, 3, complete=False)
    with pytest.raises(CheckpointError, match="none is complete.*remove them to start fresh"):
        ck.find_resume_dir(str(tmp_path), "auto", None)


def test_stale_tmp_and_old_directories_are_removed(tmp_path):
    keep = _ckpt(tmp_path, 2)
    root = tmp_path / "checkpoints"
    for name in ("global_step_4.tmp-abc123", "global_step_2.tmp-1.old"):
        (root / name / "actor").mkdir(parents=True)
    assert sorted(ck.remove_stale(str(tmp_path))) == ["global_step_2.tmp-1.old", "global_step_4.tmp-abc123"]
    assert sorted(p.name for p in root.iterdir()) == ["global_step_2"] and keep.exists()


def test_max_ckpt_to_keep_keeps_the_newest(tmp_path):
    for s in (0, 2, 4, 10):
        _ckpt(tmp_path, s)
    ck._prune(str(tmp_path / "checkpoints"), 2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["global_step_10", "global_step_4"]


def test_rng_states_round_trip_through_a_weights_only_file(tmp_path):
    from megappo.platform.cpu_compat import apply_cpu_compat
    from megatron.core import tensor_parallel

    apply_cpu_compat()
    tracker = tensor_parallel.get_cuda_rng_tracker()
    if "model-parallel-rng" not in tracker.get_states():
        tracker.add("model-parallel-rng", 1234)
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    torch.save(ck.rng_state(), tmp_path / "rng.pt")
    with tracker.fork():
        want_mp = torch.rand(3)
    want = (torch.rand(3), np.random.rand(3), random.random())
    ck.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    with tracker.fork():
        assert torch.equal(torch.rand(3), want_mp)
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(got[0], want[0]) and np.array_equal(got[1], want[1]) and got[2] == want[2]


def test_guard_trips_on_kl_and_non_finite_numbers():
    g = KLGuard(GuardConfig(), can_roll_back=True)
    assert g.check({"actor/ppo_kl": 0.01, "actor/grad_norm": 1.0}, 1) is None
    assert "actor/ppo_kl=0.5 > trainer.guard.kl_threshold=0.2" in g.check({"actor/ppo_kl": 0.5}, 2)
    assert "actor/grad_norm" in g.check({"actor/ppo_kl": 0.0, "actor/grad_norm": math.inf}, 2)
    assert "update_skipped" in g.check({"actor/update_skipped": 0.5}, 2)
    assert g.check({"kl/mean": 5.0}, 2) is None  # the default metric is actor/ppo_kl
    assert KLGuard(GuardConfig(enable=False), can_roll_back=True).check({"actor/ppo_kl": 9.0}, 1) is None


def test_guard_scales_per_rollback_and_stops_when_retries_run_out():
    g = KLGuard(GuardConfig(max_retries=2), can_roll_back=True)
    g.plan_rollback(5, "spike", "/ck/global_step_4")
    g.plan_rollback(5, "spike", "/ck/global_step_4")
    s = g.state
    assert (s.lr_scale, s.kl_scale, s.clip_scale, s.rollbacks, s.retries) == (0.25, 25.0, 0.25, 2, 2)
    with pytest.raises(RunStopped, match="after 2 rollbacks.*last good checkpoint is /ck/global_step_4"):
        g.plan_rollback(5, "spike", "/ck/global_step_4")
    assert g.check({"actor/ppo_kl": 0.0}, 6) is None and g.state.retries == 0  # past step 5: retries again
    assert g.state.lr_scale == 0.25  # the scales stay
    restored = KLGuard(GuardConfig(), can_roll_back=True)
    restored.load_state_dict(json.loads(json.dumps(g.state_dict())))
    assert restored.state == g.state


def test_guard_without_checkpoints_stops():
    with pytest.raises(RunStopped, match="no checkpoint to roll back to"):
        KLGuard(GuardConfig(), can_roll_back=False).plan_rollback(1, "spike", None)


def test_deadline_formats():
    assert parse_deadline("1800000000") == 1800000000.0
    assert parse_deadline("2026-12-04T06:00:00+00:00") == 1796364000.0
    assert parse_deadline("slurm", environ={"SLURM_JOB_END_TIME": "1796364000"}) == 1796364000.0
    with pytest.raises(ValueError, match="SLURM_JOB_END_TIME is not set"):
        parse_deadline("slurm", environ={})
    with pytest.raises(ValueError, match="ISO 8601"):
        parse_deadline("tomorrow morning")


def test_config_checks_the_new_keys():
    from megappo.checks import validate
    from megappo.config import ConfigError, load_config

    for bad, key in [("trainer.save_before_deadline=soon", "trainer.save_before_deadline"),
                     ("trainer.guard.kl_threshold=0", "trainer.guard.kl_threshold"),
                     ("reward_model.max_failure_fraction=2", "reward_model.max_failure_fraction")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            validate(load_config(None, [bad]))
