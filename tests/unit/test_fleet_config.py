"""The SGLang fleet's settings: docs/engines.md states the health-check defaults the config tree has, and settings
that cannot work are refused with the key and the fix."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from megappo.checks import validate
from megappo.config import ConfigError, load_config
from megappo.config.schema import RolloutConfig

ENGINES_PAGE = (Path(__file__).resolve().parents[2] / "docs" / "engines.md").read_text()
P = "actor_rollout_ref.rollout"


@pytest.mark.parametrize("key", ["health_check_interval_s", "health_check_timeout_s", "server_start_timeout_s"])
def test_docs_state_the_health_defaults_of_the_config_tree(key):
    stated = re.search(rf"`rollout\.{key}` \((\d+) s\)", ENGINES_PAGE)
    assert stated, f"docs/engines.md does not state rollout.{key}'s default"
    assert float(stated.group(1)) == getattr(RolloutConfig(), key)


@pytest.mark.parametrize("overrides, key, fix", [
    ([f"{P}.router=sglang"], f"{P}.router", f"set {P}.name=sglang"),
    ([f"{P}.name=sglang", f"{P}.servers_per_node=0"], f"{P}.servers_per_node", "use null"),
    ([f"{P}.name=sglang", f"{P}.api_key=-abc"], f"{P}.api_key", "starts with a letter or digit"),
    ([f"{P}.name=sglang", f"{P}.health_check_timeout_s=0"], f"{P}.health_check_timeout_s", "use seconds"),
    ([f"{P}.name=sglang", f"{P}.api_key=abc", f"{P}.api_key_file=/k"], f"{P}.api_key_file", "set one of them"),
])
def test_fleet_settings_that_cannot_work_are_refused(overrides, key, fix):
    with pytest.raises(ConfigError) as info:
        validate(load_config("cpu/tiny_ppo", overrides), world_size=1, check_files=False)
    assert key in str(info.value) and fix in str(info.value)


def test_a_router_over_started_servers_is_valid():
    cfg = load_config("cpu/tiny_ppo", [f"{P}.name=sglang", f"{P}.router=sglang", f"{P}.servers_per_node=2"])
    validate(cfg, world_size=1, check_files=False)
    assert cfg.actor_rollout_ref.rollout.router == "sglang"


def test_the_api_key_comes_from_its_file_and_a_bad_file_is_named(tmp_path, monkeypatch):
    """rollout.api_key_file keeps the key off command lines (launch/slurm/train_sglang.sbatch writes one)."""
    from megappo.trainer.preflight import preflight

    # this environment has no SGLang (its own check is tests/unit/test_preflight_edges.py): only the key is checked
    monkeypatch.setattr("megappo.rollout.sglang.deploy.sglang_missing", lambda python: None)
    from megappo.rollout.serving.server_set import configured_api_key

    key_file = tmp_path / "api_key"
    key_file.write_text("0123abcd\n")
    cfg = load_config("cpu/tiny_ppo", [f"{P}.name=sglang", f"{P}.api_key_file={key_file}"])
    preflight(cfg, world_size=1, check_files=True)
    assert configured_api_key(cfg.actor_rollout_ref.rollout) == "0123abcd"  # a string, never YAML's number
    for content, problem in (("", "is empty"), ("-x\n", "starts with '-'"), (None, "cannot read")):
        bad = tmp_path / f"bad{len(problem)}"
        if content is not None:
            bad.write_text(content)
        cfg = load_config("cpu/tiny_ppo", [f"{P}.name=sglang", f"{P}.api_key_file={bad}"])
        with pytest.raises(ConfigError) as info:
            preflight(cfg, world_size=1, check_files=True)
        assert f"{P}.api_key_file" in str(info.value) and problem in str(info.value) and str(bad) in str(info.value)
