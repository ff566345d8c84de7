"""rollout.name=vllm in the config: its two deployments (rollout.mode), the weight transports each takes, and the
settings each cannot run refused with the key and the fix, before anything starts."""
from __future__ import annotations

import pytest

from megappo.checks import validate
from megappo.config import ConfigError, load_config
from megappo.rollout import registry

P = "actor_rollout_ref.rollout"


def _errors(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        validate(load_config("cpu/tiny_ppo", overrides), world_size=1, check_files=False)
    return str(info.value)


def test_each_engine_has_its_modes_and_their_transports():
    assert registry.deployment_mode("vllm", None) == "async"  # verl's default: servers
    assert registry.deployment_mode("hf", None) == "sync" and registry.deployment_mode("sglang", None) == "async"
    assert registry.sync_modes("vllm", "sync") == ("tensor",)
    assert registry.sync_modes("vllm", "async") == ("distributed", "disk")
    assert registry.sync_modes("sglang") == ("distributed", "tensor", "disk")
    with pytest.raises(ValueError, match="the sglang engine runs as async"):
        registry.deployment_mode("sglang", "sync")


def test_vllm_configs_that_run_validate():
    for mode in ("sync", "async"):
        cfg = load_config("cpu/tiny_ppo", [f"{P}.name=vllm", f"{P}.mode={mode}"])
        validate(cfg, world_size=1, check_files=False)
    validate(load_config("cpu/tiny_ppo", [f"{P}.name=vllm", f"{P}.server_urls=[http://127.0.0.1:8000]"]),
             world_size=1, check_files=False)


@pytest.mark.parametrize("overrides, key, fix", [
    ([f"{P}.name=sglang", f"{P}.mode=sync"], f"{P}.mode", "set actor_rollout_ref.rollout.mode to one of those"),
    ([f"{P}.name=vllm", f"{P}.mode=sync", f"{P}.tensor_model_parallel_size=2"], "mode=sync",
     f"use {P}.mode=async"),
    ([f"{P}.name=vllm", f"{P}.mode=sync", f"{P}.server_urls=[http://127.0.0.1:8000]"], f"{P}.server_urls",
     "drop the URLs"),
    ([f"{P}.name=vllm", f"{P}.top_k=20", "algorithm.rollout_correction.rollout_is=token"], "top_k=20",
     "sample without the filter"),
    ([f"{P}.name=vllm", f"{P}.enable_rollout_routing_replay=true"], "Model Runner V2",
     "use router replay R2"),
    ([f"{P}.name=vllm", f"{P}.mode=sync", "async_training.mode=fully_async", "async_training.partial_rollout=true",
      "actor_rollout_ref.hybrid_engine=false"], "async_training.partial_rollout", f"use {P}.mode=async"),
])
def test_vllm_settings_that_cannot_run_are_refused(overrides, key, fix):
    err = _errors(overrides)
    assert key in err and fix in err, err


def test_weight_sync_outside_the_modes_transports_is_named():
    from megappo.trainer.preflight import preflight

    cfg = load_config("cpu/tiny_ppo", [f"{P}.name=vllm", f"{P}.mode=sync", f"{P}.weight_sync=disk"])
    with pytest.raises(ConfigError, match=r"mode=sync\) takes the weights by tensor"):
        preflight(cfg, world_size=1, check_files=False)


def test_engine_kwargs_take_verls_per_engine_sections():
    """verl's rollout.engine_kwargs has a section per engine; megappo takes the named engine's, or a flat map."""
    from megappo.trainer.settings import rollout_settings

    verl = load_config("cpu/tiny_ppo", [f"{P}.name=vllm", f"+{P}.engine_kwargs.vllm.max_num_seqs=4",
                                        f"+{P}.engine_kwargs.sglang.max_total_tokens=64"])
    assert dict(rollout_settings(verl).engine_kwargs) == {"max_num_seqs": 4}
    flat = load_config("cpu/tiny_ppo", [f"{P}.name=sglang", f"+{P}.engine_kwargs.max_total_tokens=64"])
    assert dict(rollout_settings(flat).engine_kwargs) == {"max_total_tokens": 64}
