"""The weight-sync strategy is chosen once, from the transport and what the actor's adapter object sends; whether the
engine may free its weights before a sync follows from it (only when the sync gives every weight back)."""
import json

from megappo.config import MegappoConfig
from megappo.config.schema import LoRAConfig
from megappo.models.lora import AdapterShape, FullParameters, LoRA
from megappo.trainer.settings import lora_settings
from megappo.trainer.weight_sync import (AdaptedLayers, AdapterDirectory, Disk, FullTensors, LanguageModelOnly,
                                         choose)


def _cfg(path, weight_sync="auto", lora_sync="merged", freeze_vision_tower=True) -> MegappoConfig:
    cfg = MegappoConfig()
    arr = cfg.actor_rollout_ref
    arr.model.path, arr.rollout.name = str(path), "sglang"
    arr.rollout.weight_sync, arr.rollout.lora_sync = weight_sync, lora_sync
    arr.actor.freeze_vision_tower = freeze_vision_tower
    return cfg


def _model(tmp_path, model_type: str):
    d = tmp_path / model_type
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": model_type}))
    return d


def test_strategy_by_transport_and_adapter(tmp_path):
    text, vlm = _model(tmp_path, "qwen2"), _model(tmp_path, "qwen2_5_vl")
    lora = LoRA(lora_settings(LoRAConfig(rank=4, alpha=8.0)), AdapterShape(4, 8.0, ["linear_qkv"], []), str(text))
    cases = [
        (_cfg(text), FullParameters(), FullTensors, "distributed"),
        (_cfg(text, "tensor"), FullParameters(), FullTensors, "tensor"),
        (_cfg(text, "disk"), FullParameters(), Disk, "disk"),
        (_cfg(text), lora, AdaptedLayers, "distributed"),
        (_cfg(text, "disk"), lora, Disk, "disk"),
        (_cfg(text, lora_sync="adapter"), lora, AdapterDirectory, "distributed"),
        (_cfg(vlm), FullParameters(), LanguageModelOnly, "distributed"),
        (_cfg(vlm, freeze_vision_tower=False), FullParameters(), FullTensors, "distributed"),
        (_cfg(vlm, "disk"), FullParameters(), Disk, "disk"),
    ]
    for cfg, adapter, strategy, mode in cases:
        chosen = choose(cfg, None, None, adapter)
        assert type(chosen) is strategy and chosen.setup.mode == mode, (strategy, type(chosen))
    releases = {s: s.releases_engine for s in (FullTensors, Disk, AdaptedLayers, LanguageModelOnly, AdapterDirectory)}
    assert releases == {FullTensors: True, Disk: True, AdaptedLayers: False, LanguageModelOnly: False,
                        AdapterDirectory: False}


def test_the_weight_sync_directory_follows_the_run(tmp_path):
    cfg = _cfg(_model(tmp_path, "qwen2"), "disk")
    cfg.trainer.default_local_dir = str(tmp_path / "run")
    assert choose(cfg, None, None, FullParameters()).setup.directory == str(tmp_path / "run" / "weight_sync")
    cfg.actor_rollout_ref.rollout.weight_sync_dir = str(tmp_path / "elsewhere")
    assert choose(cfg, None, None, FullParameters()).setup.directory == str(tmp_path / "elsewhere")
