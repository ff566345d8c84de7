"""model.lora: verl's megatron LoRA keys load and validate; adapter targeting by module name (no torch work)."""
from __future__ import annotations

import pytest

from megappo.checks import validate
from megappo.config import ConfigError, load_config
from megappo.config.schema import LoRAConfig
from megappo.models.lora import is_adapter_param, is_lora_target_weight
from megappo.trainer.settings import lora_settings

RECIPE = "recipes/cpu/tiny_ppo_lora.yaml"


def test_verl_lora_keys_load():
    cfg = load_config(RECIPE, ["actor_rollout_ref.model.lora.type=lora", "actor_rollout_ref.model.lora.rank=16",
                               "actor_rollout_ref.model.lora.alpha=32", "actor_rollout_ref.model.lora.dropout=0.05",
                               "actor_rollout_ref.model.lora.merge=true",
                               "actor_rollout_ref.model.lora.lora_A_init_method=kaiming",
                               "actor_rollout_ref.model.lora.target_modules=[linear_qkv,linear_proj]",
                               "actor_rollout_ref.model.lora.exclude_modules="
                               "[decoder.layers.0.self_attention.linear_qkv]",
                               "critic.model.lora.rank=8"])
    lora = cfg.actor_rollout_ref.model.lora
    assert (lora.rank, lora.alpha, lora.dropout, lora.target_modules) == (16, 32.0, 0.05, ["linear_qkv", "linear_proj"])
    assert cfg.critic.model.lora.rank == 8
    validate(cfg, 1, check_files=False)
    assert load_config("recipes/cpu/tiny_ppo.yaml").actor_rollout_ref.model.lora.rank == 0  # off by default


@pytest.mark.parametrize("override, words", [
    ("actor_rollout_ref.model.lora.target_modules=[q_proj]", "linear_qkv"),
    ("actor_rollout_ref.model.lora.rank=-1", "positive rank"),
    ("critic.model.lora.alpha=0", "alpha"),
])
def test_bad_lora_settings_are_named(override, words):
    cfg = load_config(RECIPE, [override, "critic.model.lora.rank=4"] if "critic" in override else [override])
    with pytest.raises(ConfigError, match=words):
        validate(cfg, 1, check_files=False)


def test_targets_and_exclusions():
    s = lora_settings(LoRAConfig(rank=8, target_modules=["linear_qkv", "linear_fc2"],
                                 exclude_modules=["decoder.layers.1.self_attention.linear_qkv"]))
    assert s.targets("decoder.layers.0.self_attention.linear_qkv")
    assert not s.targets("decoder.layers.1.self_attention.linear_qkv")
    assert not s.targets("decoder.layers.0.self_attention.linear_proj")
    assert s.targets("decoder.layers.3.mlp.experts.local_experts.7.linear_fc2")
    assert is_lora_target_weight("decoder.layers.0.mlp.linear_fc2.weight", s)
    assert not is_lora_target_weight("decoder.layers.0.self_attention.linear_qkv.bias", s)
    assert is_adapter_param("decoder.layers.0.mlp.linear_fc2.lora.lora_B")
    assert s.scaling == 32.0 / 8


@pytest.mark.parametrize("overrides, words", [
    (["critic.model.lora.share_actor_base=true"], "LoRA on both"),  # the critic is a full model
    (["critic.model.lora.rank=4", "critic.model.lora.share_actor_base=true", "critic.model.path=/other/model"],
     "not the actor's model"),
    (["critic.model.lora.rank=4", "critic.model.lora.share_actor_base=true",
      "critic.model.override_config={rope_theta: 5.0}"], "override_config"),
    (["actor_rollout_ref.model.lora.share_actor_base=true"], "only critic.model.lora"),
])
def test_shared_critic_base_needs_the_actors_model(overrides, words):
    cfg = load_config(RECIPE, ["actor_rollout_ref.model.path=/m", *overrides])
    with pytest.raises(ConfigError, match=words):
        validate(cfg, 1, check_files=False)
    ok = load_config(RECIPE, ["actor_rollout_ref.model.path=/m", "critic.model.lora.rank=4",
                              "critic.model.lora.share_actor_base=true"])
    validate(ok, 1, check_files=False)
    assert ok.critic.model.lora.share_actor_base and not ok.actor_rollout_ref.model.lora.share_actor_base


@pytest.mark.parametrize("overrides, words", [
    (["actor_rollout_ref.rollout.name=sglang", "trainer.device=cpu"], "CPU backend cannot serve LoRA"),
    (["actor_rollout_ref.model.lora.rank=0", "actor_rollout_ref.rollout.name=sglang", "trainer.device=cuda"],
     "lora.rank > 0"),
    (["trainer.device=cuda"], "rollout.name=vllm, or sglang on GPU"),  # the recipe's hf engine
])
def test_adapter_sync_needs_a_lora_actor_and_an_engine_that_serves_adapters(overrides, words):
    cfg = load_config(RECIPE, ["actor_rollout_ref.rollout.lora_sync=adapter", *overrides])
    with pytest.raises(ConfigError, match=words):
        validate(cfg, 1, check_files=False)
    assert load_config(RECIPE).actor_rollout_ref.rollout.lora_sync == "merged"
    for device in ("cpu", "cuda"):  # vLLM serves adapters on both (tests/e2e/test_vllm_fleet.py on CPU)
        validate(load_config(RECIPE, ["actor_rollout_ref.rollout.lora_sync=adapter", f"trainer.device={device}",
                                      "actor_rollout_ref.rollout.name=vllm"]), 1, check_files=False)


def test_sglang_lora_flags_and_cpu_refusal():
    from megappo.platform import detect_platform
    from megappo.rollout.sglang.server_set import lora_server_args
    from megappo.trainer.settings import rollout_settings

    cfg = load_config(RECIPE, ["actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.lora_sync=adapter",
                               "actor_rollout_ref.model.lora.target_modules=[linear_qkv,linear_fc2]"])
    cpu = detect_platform(device="cpu")
    with pytest.raises(ValueError, match="pin_memory"):
        lora_server_args(rollout_settings(cfg), cpu)
    import dataclasses

    import torch

    gpu = dataclasses.replace(cpu, device=torch.device("cuda"))  # the flags a GPU server gets (nothing starts)
    assert lora_server_args(rollout_settings(cfg), gpu) == [
        "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "down_proj", "k_proj", "q_proj", "v_proj",
        "--max-loras-per-batch", "2"]
    cfg.actor_rollout_ref.rollout.lora_sync = "merged"
    assert lora_server_args(rollout_settings(cfg), gpu) == []
