"""`model.trust_remote_code` (default false): Python shipped with a model directory (config.json's `auto_map`) runs
only when asked. The model's module writes a marker file when imported; with the default it must not exist."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

_MODULE = '''
import pathlib

pathlib.Path({marker!r}).write_text("ran")

from transformers import LlamaConfig, LlamaForCausalLM


class EvilConfig(LlamaConfig):
    model_type = "megappo_remote"


class EvilForCausalLM(LlamaForCausalLM):
    config_class = EvilConfig
'''


@pytest.fixture
def remote_dir(hf_model_dir, tmp_path, monkeypatch):
    """A tiny llama whose config names a model type only its own `remote_model.py` defines."""
    import transformers.dynamic_module_utils as dmu

    monkeypatch.setattr(dmu, "HF_MODULES_CACHE", str(tmp_path / "hf_modules"))  # transformers copies the code here
    d = tmp_path / "remote"
    shutil.copytree(hf_model_dir("llama"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="megappo_remote", auto_map={"AutoConfig": "remote_model.EvilConfig",
                                                      "AutoModelForCausalLM": "remote_model.EvilForCausalLM"})
    (d / "config.json").write_text(json.dumps(cfg))
    marker = tmp_path / "remote_code_ran"
    (d / "remote_model.py").write_text(_MODULE.format(marker=str(marker)))
    return d, marker


def test_rollout_engine_runs_model_code_only_when_trusted(remote_dir):
    from megappo.rollout.hf.engine import HFEngine

    d, marker = remote_dir
    with pytest.raises(ValueError, match="trust_remote_code"):
        HFEngine(str(d))
    assert not marker.exists()
    engine = HFEngine(str(d), trust_remote_code=True)
    assert marker.exists() and type(engine.model).__name__ == "EvilForCausalLM"


def test_convert_verify_runs_model_code_only_when_trusted(remote_dir):
    from megappo.convert.mapping import ConversionError
    from megappo.convert.verify import hf_forward

    d, marker = remote_dir
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ConversionError, match="asks to run Python shipped with the model .*--trust-remote-code"):
        hf_forward(str(d), ids, value=False)
    assert not marker.exists()
    assert hf_forward(str(d), ids, value=False, trust_remote_code=True).shape[:2] == (1, 4) and marker.exists()


def test_flags_reach_sglang_and_the_convert_command(tmp_path, capsys):
    from megappo.cli import main
    from megappo.rollout.sglang.server import SGLangServer

    servers = [SGLangServer(str(tmp_path)), SGLangServer(str(tmp_path), trust_remote_code=True)]  # not started
    for s in servers:
        s.log.close()
        os.unlink(s.log.name)
    assert "--trust-remote-code" not in servers[0].cmd and "--trust-remote-code" in servers[1].cmd
    with pytest.raises(SystemExit):
        main(["convert", "verify", "--help"])
    assert "--trust-remote-code" in capsys.readouterr().out


def test_the_trainer_rollout_passes_the_config_key(remote_dir):
    """RolloutWorker builds its engine (and would start SGLang) with `actor_rollout_ref.model.trust_remote_code`
    (one rank, a world of one)."""
    from megappo.config import MegappoConfig
    from megappo.parallel import destroy_parallel, init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout
    from megappo.trainer.rollout import RolloutWorker

    d, marker = remote_dir
    cfg = MegappoConfig()
    cfg.actor_rollout_ref.model.path = str(d)
    cfg.actor_rollout_ref.rollout.name = "hf"
    platform = detect_platform(dtype="float32")
    ps = init_parallel(ParallelLayout(), platform)
    try:
        with pytest.raises(ValueError, match="trust_remote_code"):
            RolloutWorker(cfg, ps, platform)
        assert not marker.exists()
        cfg.actor_rollout_ref.model.trust_remote_code = True
        worker = RolloutWorker(cfg, ps, platform)
        assert type(worker.engine.model).__name__ == "EvilForCausalLM" and marker.exists()
        from megappo.rollout.sglang.deploy import server_kwargs
        from megappo.trainer.settings import rollout_settings

        assert server_kwargs(rollout_settings(cfg), platform)["trust_remote_code"] is True  # what an SGLang server would be started with
    finally:
        destroy_parallel(destroy_process_group=True)
