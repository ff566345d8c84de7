"""`megappo train` through the real console entry point (`megappo.cli.main`)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import yaml

from megappo.cli import main


def test_print_config_prints_the_resolved_tree(capsys):
    rc = main(["train", "--config", "gsm8k_tiny_cpu", "--print-config",
               "actor_rollout_ref.actor.use_kl_loss=true", "algorithm.kl_ctrl.type=adaptive"])
    out = capsys.readouterr().out
    assert rc == 0
    tree = yaml.safe_load(out)
    assert tree["actor_rollout_ref"]["actor"]["use_kl_loss"] is True
    assert tree["algorithm"]["kl_ctrl"]["type"] == "adaptive"
    assert tree["actor_rollout_ref"]["rollout"]["response_length"] == 32  # derived from data.max_response_length
    assert tree["actor_rollout_ref"]["actor"]["clip_ratio_low"] == 0.2


def test_unknown_key_exits_1_with_the_closest_key(capsys):
    rc = main(["train", "--print-config", "actor_rollout_ref.actor.use_kl_los=true"])
    err = capsys.readouterr().err
    assert rc == 1 and "did you mean 'actor_rollout_ref.actor.use_kl_loss'" in err


def test_print_config_reports_rule_violations(capsys):
    rc = main(["train", "--config", "gsm8k_tiny_cpu", "--print-config", "actor_rollout_ref.actor.clip_ratio_c=0.5"])
    captured = capsys.readouterr()
    assert rc == 1 and "clip_ratio_c: must be > 1" in captured.err and "actor_rollout_ref:" in captured.out


@pytest.fixture
def runnable(tmp_path):
    """Overrides pointing the tiny recipe at files that exist (validation only checks presence and config.json)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_key_value_heads": 2,
                                                   "num_hidden_layers": 4}))
    for name in ("train.parquet", "test.parquet"):
        (tmp_path / name).write_bytes(b"")
    return ["--config", "gsm8k_tiny_cpu", f"actor_rollout_ref.model.path={model}",
            f"data.train_files={tmp_path / 'train.parquet'}", f"data.val_files={tmp_path / 'test.parquet'}"]


def test_dry_run_validates_files(runnable, capsys):
    assert main(["train", "--dry-run", *runnable]) == 0
    assert "config OK" in capsys.readouterr().out
    assert main(["train", "--dry-run", *runnable, "data.train_files=/nonexistent.parquet"]) == 1
    assert "'/nonexistent.parquet' does not exist" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("megappo.trainer") is not None, reason="the trainer exists now")
def test_without_trainer_exits_2_with_a_clear_message(runnable, capsys):
    assert main(["train", *runnable]) == 2
    assert "lands in a later release" in capsys.readouterr().err


def test_help_shows_override_examples(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert "--print-config" in out and "algorithm.kl_ctrl.type=adaptive" in out


def test_registration_imports_neither_torch_nor_megatron():
    code = ("import argparse, sys; from megappo.train_cli import register; "
            "register(argparse.ArgumentParser().add_subparsers()); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'yaml')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
