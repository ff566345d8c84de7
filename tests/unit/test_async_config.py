"""The asynchronous trainer's and the rollout correction's settings are checked before anything starts, each error
naming the key and the fix."""
from __future__ import annotations

import pytest

from megappo.config import ConfigError, load_config
from megappo.trainer.preflight import preflight

A = "async_training"


def _errors(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        preflight(load_config("cpu/tiny_ppo", list(overrides)), world_size=1)
    return str(e.value)


def _problems(*overrides: str) -> str:
    """preflight's errors, or "" when it takes the config."""
    try:
        preflight(load_config("cpu/tiny_ppo", list(overrides)), world_size=1)
    except ConfigError as e:
        return str(e)
    return ""


def test_async_modes_need_the_engine_beside_the_trainer():
    for mode in ("one_step_off", "fully_async"):
        assert "set actor_rollout_ref.hybrid_engine=false" in _errors(f"{A}.mode={mode}", "data.train_batch_size=32")


def test_fully_async_steps_are_require_batches_mini_batches():
    msg = _errors(f"{A}.mode=fully_async", "actor_rollout_ref.hybrid_engine=false", f"{A}.require_batches=3")
    assert "data.train_batch_size: is 64 but a fully_async step trains async_training.require_batches=3" in msg
    assert "set it to 96" in msg
    preflight(load_config("cpu/tiny_ppo", [f"{A}.mode=fully_async", "actor_rollout_ref.hybrid_engine=false",
                                           f"{A}.require_batches=2"]), world_size=1)


def test_fully_async_bounds_and_partial_rollouts(monkeypatch):
    from megappo.rollout import registry

    base = [f"{A}.mode=fully_async", "actor_rollout_ref.hybrid_engine=false", f"{A}.require_batches=2"]
    assert "async_training.staleness_threshold: must be >= 0" in _errors(*base, f"{A}.staleness_threshold=-1")
    assert "async_training.trigger_parameter_sync_step: must be >= 1" in _errors(
        *base, f"{A}.trigger_parameter_sync_step=0")
    for name in ("hf", "sglang"):  # both continue aborted generations
        urls = ["actor_rollout_ref.rollout.server_urls=[http://127.0.0.1:1]"] if name == "sglang" else []
        assert "partial_rollout" not in _problems(*base, f"{A}.partial_rollout=true",
                                                  f"actor_rollout_ref.rollout.name={name}", *urls)
    # an engine whose registry entry does not say it keeps aborted tokens (a new one, as docs/engines.md's vLLM)
    monkeypatch.setitem(registry.ENGINES, "toy", {"deploy": "megappo.rollout.hf.deploy:deploy",
                                                  "sync_modes": ("tensor",)})
    msg = _errors(*base, f"{A}.partial_rollout=true", "actor_rollout_ref.rollout.name=toy")
    assert "async_training.partial_rollout: needs an engine that returns aborted generations' tokens" in msg


def test_rollout_correction_values_are_checked():
    c = "algorithm.rollout_correction"
    assert "rollout_rs: invalid option 'seq_max_k1'" in _errors(f"{c}.rollout_rs=seq_max_k1")
    assert f"{c}.rollout_is_threshold" in _errors(f"{c}.rollout_is=token", f"{c}.rollout_is_threshold=0_x")
    preflight(load_config("cpu/tiny_ppo", [f"{c}.rollout_is=sequence", f"{c}.rollout_is_threshold=0.5_2.0",
                                           f"{c}.rollout_rs=seq_mean_k1,token_k3",
                                           f"{c}.rollout_rs_threshold=0.9_1.1,2"]),
              world_size=1)
