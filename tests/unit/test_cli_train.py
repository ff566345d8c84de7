"""`megappo train` through the real console entry point (`megappo.cli.main`)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from megappo.cli import main


def test_print_config_prints_the_resolved_tree(capsys):
    rc = main(["train", "--config", "gsm8k/tiny_cpu", "--print-config",
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


def test_print_config_prints_nothing_for_an_invalid_config(capsys):
    rc = main(["train", "--config", "gsm8k/tiny_cpu", "--print-config", "actor_rollout_ref.actor.clip_ratio_c=0.5"])
    captured = capsys.readouterr()
    assert rc == 1 and "clip_ratio_c: must be > 1" in captured.err and captured.out == ""
    # layout problems too (preflight), but never the files: printing needs no model or data on this machine
    rc = main(["train", "--config", "gsm8k/tiny_cpu", "--print-config",
               "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"])
    captured = capsys.readouterr()
    assert rc == 1 and "world size 1 is not divisible" in captured.err and captured.out == ""
    assert main(["train", "--config", "gsm8k/tiny_cpu", "--print-config", "data.train_files=/nowhere.parquet"]) == 0


@pytest.fixture
def runnable(tmp_path, tokenizer_dir):
    """Overrides pointing the tiny recipe at a model config.json, a tokenizer and Parquet files in verl's schema."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_key_value_heads": 2,
                                                   "num_hidden_layers": 4}))
    rows = pa.table({"data_source": ["openai/gsm8k"] * 4, "prompt": [[{"role": "user", "content": "1+1?"}]] * 4,
                     "reward_model": [{"style": "rule", "ground_truth": "2"}] * 4})
    for name in ("train.parquet", "test.parquet"):
        pq.write_table(rows, tmp_path / name)
    return ["--config", "gsm8k/tiny_cpu", f"actor_rollout_ref.model.path={model}",
            f"data.train_files={tmp_path / 'train.parquet'}", f"data.val_files={tmp_path / 'test.parquet'}",
            f"data.tokenizer={tokenizer_dir}"]


def test_dry_run_validates_files(runnable, tmp_path, capsys):
    assert main(["train", "--dry-run", *runnable]) == 0
    assert "config OK" in capsys.readouterr().out
    assert main(["train", "--dry-run", *runnable, "data.train_files=/nonexistent.parquet"]) == 1
    assert "'/nonexistent.parquet' does not exist" in capsys.readouterr().err
    (tmp_path / "blank.parquet").write_bytes(b"")
    reward = tmp_path / "reward.py"
    reward.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    assert main(["train", "--dry-run", *runnable, f"data.val_files={tmp_path / 'blank.parquet'}",
                 f"custom_reward_function.path={reward}"]) == 1
    err = capsys.readouterr().err
    assert "data.val_files: " in err and "the file is empty" in err
    assert "custom_reward_function.name: " in err and "defines no 'compute_score'" in err


def test_dry_run_of_a_synthetic_task_needs_no_files(capsys):
    assert main(["train", "--dry-run", "--config", "gsm8k/tiny_cpu", "data.synthetic.name=digit_max",
                 "data.synthetic.num_train_prompts=16", "data.train_files=/nowhere.parquet",
                 "data.max_prompt_length=64", "data.max_response_length=8"]) == 0  # the task model has 128 positions
    assert "synthetic task digit_max" in capsys.readouterr().out


def test_train_checks_before_it_starts_the_trainer(runnable, monkeypatch, capsys):
    import megappo.trainer

    calls = []
    monkeypatch.setattr(megappo.trainer, "fit", lambda cfg: calls.append(cfg) or 0)
    assert main(["train", *runnable, "data.train_files=/nonexistent.parquet"]) == 1 and not calls
    assert "does not exist" in capsys.readouterr().err
    assert main(["train", *runnable]) == 0 and len(calls) == 1
    assert calls[0].trainer.experiment_name == "gsm8k_tiny_cpu"


def test_train_refuses_a_world_that_is_not_the_configs(runnable, monkeypatch, capsys):
    import megappo.trainer

    calls = []
    monkeypatch.setattr(megappo.trainer, "fit", lambda cfg: calls.append(cfg) or 0)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    two = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"]
    assert main(["train", *runnable, *two]) == 1 and not calls
    err = capsys.readouterr().err
    assert "asks for 2 ranks" in err and "but 1 were started" in err and "torchrun --nproc-per-node 2" in err


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
