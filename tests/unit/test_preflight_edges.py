"""Rough edges a new user hits (issue 21): each ends in a message naming the key and the fix, before any work."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megappo.cli import main
from megappo.config import ConfigError, load_config
from megappo.rollout.serving.probe import package_missing
from megappo.rollout.sglang import deploy as sd
from megappo.trainer import preflight as pf

ROOT = Path(__file__).resolve().parents[2]
R = "actor_rollout_ref.rollout"


def _errors(cfg, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        pf.preflight(cfg, **kwargs)
    return str(info.value)


@pytest.fixture
def no_trainer(monkeypatch):
    """megappo.trainer.fit replaced by a recorder: a test asserts it was never reached."""
    import megappo.trainer

    calls = []
    monkeypatch.setattr(megappo.trainer, "fit", lambda cfg: calls.append(cfg) or 0)
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK"):
        monkeypatch.delenv(var, raising=False)
    return calls


# ------------------------------------------------------------------------------------------------------------------
# 1. an output directory that cannot be created
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs Linux /proc")
def test_an_output_dir_that_cannot_be_created_is_named_before_training(no_trainer, capsys):
    for extra in (["--dry-run"], []):
        rc = main(["train", "--config", "cpu/tiny_ppo", *extra, "trainer.default_local_dir=/proc/megappo-x/run"])
        err = capsys.readouterr().err
        assert rc == 1 and not no_trainer
        assert "trainer.default_local_dir: '/proc/megappo-x/run' cannot be created in '/proc'" in err
        assert "set trainer.default_local_dir=DIR" in err and "Traceback" not in err


def test_output_dir_checks_create_nothing(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert "is a file" in pf.output_dir_problem(str(afile / "run"))
    assert "is a file, not a directory" in pf.output_dir_problem(str(afile))
    assert pf.output_dir_problem(str(tmp_path / "a" / "b")) is None
    assert pf.output_dir_problem(str(tmp_path)) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # the probe left nothing behind
    cfg = load_config("cpu/tiny_ppo", [f"trainer.default_local_dir={afile}/run"])
    assert "trainer.default_local_dir: " in _errors(cfg)
    with pytest.raises(ConfigError, match="trainer.default_local_dir"):
        pf.require_output_dir(cfg)
    pf.preflight(cfg, world_size=1)  # a planning check (no files) does not look at it


# ------------------------------------------------------------------------------------------------------------------
# 2. rollout.name=sglang where the server's python has no SGLang
# ------------------------------------------------------------------------------------------------------------------
def _without_sglang() -> str:
    python = sys.executable  # the project's environment: SGLang lives in its own venv (tools/sglang)
    if subprocess.run([python, "-c", "import sglang"], capture_output=True).returncode == 0:
        pytest.skip("this python has sglang")
    return python


def test_sglang_missing_from_server_python_fails_fast_without_starting_servers(no_trainer, monkeypatch, capsys):
    python = _without_sglang()
    import megappo.rollout.sglang.server as server_mod

    monkeypatch.setattr(server_mod.SGLangServer, "start", lambda *a, **k: pytest.fail("a server was started"))
    package_missing.cache_clear()
    t0 = time.monotonic()
    rc = main(["train", "--config", "cpu/tiny_ppo", f"{R}.name=sglang", f"{R}.server_python={python}"])
    err = capsys.readouterr().err
    assert rc == 1 and not no_trainer and time.monotonic() - t0 < 30
    assert f"'{python}' has no sglang package" in err and f"{R}.server_python" in err
    assert 'pip install "megappo[sglang]"' in err and "tools/sglang/install_cpu.sh VENV" in err
    # unset server_python means this python: named as such
    cfg = load_config("cpu/tiny_ppo", [f"{R}.name=sglang"])
    assert f"{R}.server_python (unset: this python)" in _errors(cfg)


def test_sglang_is_not_probed_for_hf_or_for_servers_given_by_url(monkeypatch):
    monkeypatch.setattr(sd, "sglang_missing", lambda python: pytest.fail(f"probed {python}"))
    pf.preflight(load_config("cpu/tiny_ppo", [f"{R}.name=hf", f"{R}.server_python=/nonexistent/python"]))
    pf.preflight(load_config("cpu/tiny_ppo", [f"{R}.name=sglang", f"{R}.server_urls=[http://10.0.0.1:30000]",
                                              f"{R}.server_python=/nonexistent/python"]))


def test_a_server_python_that_cannot_run_is_named():
    package_missing.cache_clear()
    assert "cannot be run" in sd.sglang_missing("/nonexistent/python")


def test_a_server_python_with_sglang_passes(tmp_path):
    """A python that finds an `sglang` package (here a stand-in on its own path) is accepted."""
    (tmp_path / "site" / "sglang").mkdir(parents=True)
    (tmp_path / "site" / "sglang" / "__init__.py").write_text("")
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={tmp_path / 'site'} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    package_missing.cache_clear()
    assert sd.sglang_missing(str(python)) is None
    pf.preflight(load_config("cpu/tiny_ppo", [f"{R}.name=sglang", f"{R}.server_python={python}"]))


def test_rollout_server_without_sglang_exits_2_naming_python_and_the_cpu_venv(monkeypatch, tmp_path, capsys):
    python = _without_sglang()
    import megappo.rollout.sglang.server as server_mod

    monkeypatch.setattr(server_mod, "SGLangServer", lambda *a, **k: pytest.fail("a server was made"))
    url_file = tmp_path / "url.json"
    rc = main(["rollout-server", "--model", str(tmp_path), "--url-file", str(url_file), "--python", python])
    err = capsys.readouterr().err
    assert rc == 2 and not url_file.exists()
    assert "--python" in err and f"'{python}' has no sglang package" in err
    assert "tools/sglang/install_cpu.sh VENV" in err and 'pip install "megappo[sglang]"' in err


def test_rollout_server_for_vllm_without_vllm_exits_2_naming_python_and_the_cpu_venv(monkeypatch, tmp_path, capsys):
    import megappo.rollout.vllm.server as server_mod

    monkeypatch.setattr(server_mod, "VLLMServer", lambda *a, **k: pytest.fail("a server was made"))
    url_file = tmp_path / "url.json"
    rc = main(["rollout-server", "--engine", "vllm", "--model", str(tmp_path), "--url-file", str(url_file)])
    err = capsys.readouterr().err
    assert rc == 2 and not url_file.exists()
    assert "--python (unset: this python)" in err and "has no vllm package" in err
    assert "tools/vllm/install_cpu.sh VENV" in err and 'pip install "megappo[vllm]"' in err


def test_install_cpu_sh_prints_the_line_to_use():
    script = (ROOT / "tools" / "sglang" / "install_cpu.sh").read_text()
    echoes = [line for line in script.splitlines() if line.lstrip().startswith("echo")]
    assert any(f"{R}.server_python=$py" in line for line in echoes)
    assert any("megappo rollout-server --python $py" in line for line in echoes)


# ------------------------------------------------------------------------------------------------------------------
# 3. an unknown key's suggestion stays in its section
# ------------------------------------------------------------------------------------------------------------------
def _unknown(override: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    return str(info.value)


def test_unknown_key_suggestion_prefers_its_own_section():
    msg = _unknown("actor_rollout_ref.model.use_fused_kernels=true")
    assert "server_python" not in msg and "actor_rollout_ref.rollout" not in msg
    assert "valid keys under 'actor_rollout_ref.model': path, tokenizer_path" in msg
    assert "did you mean 'critic.model.path'" in _unknown("critic.model.pth=x")
    assert f"did you mean '{R}.val_kwargs.temperature'" in _unknown(f"{R}.val_kwargs.temprature=1")
    assert f"did you mean '{R}.server_python'" in _unknown(f"{R}.servr_python=x")
    # a typo one level up still finds its key (the nearest section that has a close one)
    assert "did you mean 'actor_rollout_ref.model.path'" in _unknown("actor_rollout_ref.modle.path=x")
    # and the global fallback: the same name in another group
    assert "did you mean 'reward_model.path'" in _unknown("reward_model.model.path=x")


# ------------------------------------------------------------------------------------------------------------------
# 4. prompt + response longer than the model's positions
# ------------------------------------------------------------------------------------------------------------------
def _model(tmp_path, positions: int) -> str:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_key_value_heads": 2,
                                                   "num_hidden_layers": 4, "max_position_embeddings": positions}))
    return str(model)


def test_prompt_plus_response_longer_than_the_models_positions_is_named(tmp_path):
    base = [f"actor_rollout_ref.model.path={_model(tmp_path, 256)}", "data.max_response_length=32"]
    msg = _errors(load_config("gsm8k/tiny_cpu", [*base, "data.max_prompt_length=240"]), world_size=1)
    assert "data.max_prompt_length + data.max_response_length: 240 + 32 = 272 tokens exceed " \
           "max_position_embeddings=256" in msg
    assert "at most 256" in msg
    pf.preflight(load_config("gsm8k/tiny_cpu", [*base, "data.max_prompt_length=224"]), world_size=1)
    # the model's positions raised by override_config count
    pf.preflight(load_config("gsm8k/tiny_cpu", [*base, "data.max_prompt_length=240",
                                                "actor_rollout_ref.model.override_config.max_position_embeddings=512"]),
                 world_size=1)


def test_the_synthetic_tasks_model_size_is_checked_too(capsys):
    msg = _errors(load_config("cpu/tiny_ppo", ["data.max_response_length=200"]), world_size=1)
    assert "max_position_embeddings=128 of the synthetic task digit_max's model" in msg
    assert main(["train", "--config", "cpu/tiny_ppo", "--dry-run", "data.max_response_length=200"]) == 1
    assert "data.max_prompt_length + data.max_response_length" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------------------
# 5. a multi-node launch whose config says one node
# ------------------------------------------------------------------------------------------------------------------
def test_launch_mismatch_names_the_keys_that_match_the_launch():
    from megappo.train_cli import launch_mismatch

    msg = launch_mismatch(1, 1, {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"})
    assert "torchrun started 2 ranks (2 node(s) x 1 per node)" in msg and "add trainer.nnodes=2 to" in msg
    assert "n_gpus_per_node=" not in msg.split("add ")[1].split(" to the command")[0]
    msg = launch_mismatch(1, 1, {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"})
    assert "add trainer.nnodes=2 trainer.n_gpus_per_node=8 to the command" in msg
    assert launch_mismatch(2, 8, {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}) is None
    assert launch_mismatch(1, 1, {}) is None
    assert "torchrun --nproc-per-node 8" in launch_mismatch(2, 8, {})


def test_a_two_node_launch_of_a_one_node_config_is_told_once(no_trainer, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        # the config's tp=2 would not fit its own 1 rank: the launch is named first, not that
        rc = main(["train", "--config", "cpu/tiny_ppo",
                   "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"])
        err = capsys.readouterr().err
        assert rc == 1 and not no_trainer
        if rank == "0":
            assert err.count("megappo train:") == 1 and "add trainer.nnodes=2 to the command" in err
            assert "Traceback" not in err and "not divisible" not in err
        else:
            assert err == ""


def test_docs_by_hand_multi_node_example_shows_the_keys():
    page = (ROOT / "docs" / "multi-node.md").read_text()
    by_hand = page[page.index("**By hand**"):page.index("**Slurm**")]
    assert "trainer.nnodes=2 trainer.n_gpus_per_node=8" in re.sub(r"\s+", " ", by_hand)


# ------------------------------------------------------------------------------------------------------------------
# 6-8. The docs (docs/*.md) and help texts agree with the code
# ------------------------------------------------------------------------------------------------------------------
def test_docs_validation_text_matches_test_freq_default():
    from megappo.config.schema import TrainerConfig

    page = re.sub(r"\s+", " ", (ROOT / "docs" / "training.md").read_text())
    assert TrainerConfig().test_freq == -1
    assert "`trainer.test_freq` steps and at the last (as in verl, only with `test_freq` > 0" in page


def test_a_missing_model_dir_says_how_to_make_a_tiny_one(tmp_path, capsys):
    assert main(["train", "--config", "gsm8k/tiny_cpu", "--dry-run",
                 f"actor_rollout_ref.model.path={tmp_path / 'nowhere'}"]) == 1
    err = capsys.readouterr().err
    assert "has no config.json" in err and pf.MAKE_TINY_MODEL in err
    # a directory that exists but is no model: no such hint
    assert main(["train", "--config", "gsm8k/tiny_cpu", "--dry-run", f"actor_rollout_ref.model.path={tmp_path}"]) == 1
    err = capsys.readouterr().err
    assert "has no config.json" in err and pf.MAKE_TINY_MODEL not in err
    page = re.sub(r"\s+", " ", (ROOT / "docs" / "training.md").read_text())
    assert "`tiny_cpu.yaml` on GSM8K and a tiny model you point it at: `python -m megappo.testing model " \
           "--family qwen2 --out ~/models/tiny-qwen2`" in page


def test_convert_memory_text_agrees_with_docs(capsys):
    with pytest.raises(SystemExit):
        main(["convert", "hf-to-mcore", "--help"])
    help_text = re.sub(r"\s+", " ", capsys.readouterr().out)
    page = (ROOT / "docs" / "commands.md").read_text()
    assert "one bucket plus the largest tensor" in help_text and "twice" not in help_text
    assert "memory is one bucket plus the largest tensor" in page


def test_rollout_server_help_opens_with_what_it_is(capsys):
    with pytest.raises(SystemExit):
        main(["rollout-server", "--help"])
    out = capsys.readouterr().out
    description = out.split("\n\n")[1]
    assert description.startswith("Runs one server (`--engine sglang`")


def test_quickstart_no_longer_waits_for_the_trainer():
    assert "until the PPO trainer lands" not in (ROOT / "tools" / "quickstart.sh").read_text()


def test_data_gsm8k_output_dir_follows_the_umask(tmp_path):
    from megappo.data.gsm8k import convert

    samples = ROOT / "megappo" / "data" / "samples" / "gsm8k"
    old = os.umask(0o022)
    try:
        convert(str(samples), str(tmp_path / "a" / "out"))
        assert (tmp_path / "a" / "out").stat().st_mode & 0o777 == 0o755
        os.umask(0o027)
        convert(str(samples), str(tmp_path / "b"))
        assert (tmp_path / "b").stat().st_mode & 0o777 == 0o750
    finally:
        os.umask(old)


# ------------------------------------------------------------------------------------------------------------------
# 9. the reward registry and the synthetic tasks import each other no more
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("first", ["megappo.tasks.synthetic", "megappo.rewards.registry", "megappo.rewards"])
def test_registry_and_synthetic_tasks_import_in_either_order(first):
    code = (f"import {first}\n"
            "import sys\n"
            "from megappo.rewards.registry import get_reward_fn, registered_data_sources\n"
            "print(get_reward_fn('megappo/digit_max')('megappo/digit_max', '7', '7'), "
            "'megappo/digit_max' in registered_data_sources(), get_reward_fn('gsm8k').__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1.0", "True", "gsm8k_reward"]


def test_registry_does_not_import_the_tasks_at_import_time():
    code = "import sys, megappo.rewards.registry; print('megappo.tasks.synthetic' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.stdout.strip() == "False", out.stderr
