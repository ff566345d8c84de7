"""The configuration tree: issue defaults, recipe and CLI merging, error messages, derived defaults, validation."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from megappo.checks import validate
from megappo.config import ConfigError, MegappoConfig, from_dict, load_config, resolve, to_dict, to_yaml
from megappo.config.loader import RECIPES_DIR, bundled_recipes, find_recipe
from megappo.trainer.preflight import preflight

MODEL = ["actor_rollout_ref.model.path=/models/m"]


def get(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def errors_of(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    return str(info.value)


# ------------------------------------------------------------------------------------------------------------------
# defaults: every key and default the issue lists, plus the megappo-specific groups
# ------------------------------------------------------------------------------------------------------------------
ISSUE_DEFAULTS = {
    "algorithm.gamma": 1.0, "algorithm.lam": 1.0, "algorithm.adv_estimator": "gae",
    "algorithm.use_kl_in_reward": False, "algorithm.kl_penalty": "kl",
    "algorithm.kl_ctrl.type": "fixed", "algorithm.kl_ctrl.kl_coef": 0.001, "algorithm.kl_ctrl.target_kl": 0.1,
    "algorithm.kl_ctrl.horizon": 10000,
    "actor_rollout_ref.actor.clip_ratio": 0.2, "actor_rollout_ref.actor.clip_ratio_low": 0.2,
    "actor_rollout_ref.actor.clip_ratio_high": 0.2, "actor_rollout_ref.actor.clip_ratio_c": 3.0,
    "actor_rollout_ref.actor.loss_agg_mode": "token-mean", "actor_rollout_ref.actor.entropy_coeff": 0,
    "actor_rollout_ref.actor.use_kl_loss": False, "actor_rollout_ref.actor.kl_loss_coef": 0.001,
    "actor_rollout_ref.actor.kl_loss_type": "low_var_kl", "actor_rollout_ref.actor.ppo_epochs": 1,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 256, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": None,
    "actor_rollout_ref.actor.use_dynamic_bsz": False, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 16384,
    "actor_rollout_ref.actor.optim.lr": 1e-6, "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": 0.0,
    "actor_rollout_ref.actor.optim.lr_scheduler": "constant", "actor_rollout_ref.actor.optim.clip_grad": 1.0,
    "actor_rollout_ref.actor.optim.weight_decay": 0.01,
    "actor_rollout_ref.model.path": None,
    "actor_rollout_ref.rollout.name": "hf", "actor_rollout_ref.rollout.n": 1,
    "actor_rollout_ref.rollout.temperature": 1.0, "actor_rollout_ref.rollout.top_p": 1.0,
    "actor_rollout_ref.rollout.top_k": -1, "actor_rollout_ref.rollout.response_length": 512,
    "actor_rollout_ref.rollout.gpu_memory_utilization": 0.5,
    "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
    "actor_rollout_ref.rollout.max_num_batched_tokens": 8192,
    "critic.cliprange_value": 0.5, "critic.ppo_epochs": 1, "critic.optim.lr": 1e-5, "critic.model.path": None,
    "data.train_files": "~/data/gsm8k/train.parquet", "data.val_files": "~/data/gsm8k/test.parquet",
    "data.train_batch_size": 1024, "data.max_prompt_length": 512, "data.max_response_length": 512,
    "data.truncation": "error", "data.filter_overlong_prompts": False, "data.shuffle": True, "data.seed": 1,
    "reward_model.enable": False, "reward_model.path": None,
    "custom_reward_function.path": None, "custom_reward_function.name": "compute_score",
    "trainer.nnodes": 1, "trainer.n_gpus_per_node": 8, "trainer.total_epochs": 30,
    "trainer.total_training_steps": None, "trainer.save_freq": -1, "trainer.test_freq": -1,
    "trainer.resume_mode": "auto", "trainer.resume_from_path": None,
    "trainer.default_local_dir": "checkpoints/megappo_examples/gsm8k", "trainer.logger": ["console", "tensorboard"],
    "trainer.project_name": "megappo_examples", "trainer.experiment_name": "gsm8k", "trainer.max_ckpt_to_keep": None,
    # verl keys a user expects
    "actor_rollout_ref.rollout.do_sample": True, "actor_rollout_ref.rollout.prompt_length": 512,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": None,
    "actor_rollout_ref.rollout.val_kwargs.temperature": 0.0, "actor_rollout_ref.rollout.val_kwargs.do_sample": False,
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": None,
    "actor_rollout_ref.ref.megatron.param_offload": False,
    "actor_rollout_ref.actor.megatron.router_replay.mode": "disabled",
    "actor_rollout_ref.rollout.enable_rollout_routing_replay": False,
    "trainer.val_before_train": True, "trainer.log_val_generations": 0, "critic.ppo_mini_batch_size": 256,
    # megappo-specific groups
    "reward_model.micro_batch_size_per_gpu": None, "reward_model.num_workers": 2, "reward_model.backend": "process",
    "reward_model.timeout_s": 30.0, "reward_model.failure_score": 0.0, "reward_model.ray_address": None,
    "actor_rollout_ref.model.dtype": None, "actor_rollout_ref.model.trust_remote_code": False,
    "actor_rollout_ref.model.enable_gradient_checkpointing": False,
    "trainer.device": "auto", "trainer.guard.enable": True, "trainer.guard.kl_threshold": 0.2,
    "trainer.guard.epoch_kl_stop": None, "trainer.save_before_deadline": None,
    "reward_model.max_failure_fraction": 0.5, "reward_model.max_failure_steps": 3,
}
MEGATRON_DEFAULTS = {
    "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "virtual_pipeline_model_parallel_size": None,
    "expert_model_parallel_size": 1, "expert_tensor_parallel_size": None, "context_parallel_size": 1,
    "sequence_parallel": False, "param_offload": False, "grad_offload": False, "optimizer_offload": False,
    "use_distributed_optimizer": False, "seed": 42, "router_replay": {"mode": "disabled"},
}


def test_issue_defaults():
    cfg = load_config()
    def same(a, b):  # 1 == True in Python; a bool default must stay a bool
        return a == b and isinstance(a, bool) == isinstance(b, bool)

    wrong = {k: get(cfg, k) for k, v in ISSUE_DEFAULTS.items() if not same(get(cfg, k), v)}
    assert not wrong, f"defaults that differ from the issue: {wrong}"
    for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic"):
        assert dataclasses.asdict(get(cfg, role).megatron) == MEGATRON_DEFAULTS, role
    raw = MegappoConfig()  # before resolve: the derived keys are unset
    assert raw.actor_rollout_ref.actor.clip_ratio_low is None and raw.actor_rollout_ref.actor.clip_ratio_high is None
    assert set(to_dict(cfg)) == {"data", "actor_rollout_ref", "critic", "reward_model", "custom_reward_function",
                                 "algorithm", "trainer", "async_training", "distillation"}
    # verl's distillation names and defaults (verl/workers/config/distillation.py)
    dl = dataclasses.asdict(cfg.distillation.distillation_loss)
    assert dl == {"loss_mode": "k3", "topk": 128, "use_task_rewards": True, "distillation_loss_coef": 1.0,
                  "loss_max_clamp": 10.0, "log_prob_min_clamp": -10.0, "use_policy_gradient": True}
    assert not cfg.distillation.enabled and cfg.distillation.teacher_model.model_path is None
    # verl's names and defaults for the asynchronous trainer and verl 0.9.1's rollout correction (its YAML's)
    assert dataclasses.asdict(cfg.async_training) == {
        "mode": "sync", "require_batches": 1, "trigger_parameter_sync_step": 1, "staleness_threshold": 0.1,
        "partial_rollout": False}
    assert dataclasses.asdict(cfg.algorithm.rollout_correction) == {
        "rollout_is": None, "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": False, "rollout_rs": None,
        "rollout_rs_threshold": None, "bypass_mode": False, "loss_type": "ppo_clip", "preset": None}


def test_derived_defaults_follow_their_source():
    cfg = load_config(None, ["actor_rollout_ref.actor.clip_ratio=0.3", "actor_rollout_ref.actor.clip_ratio_high=0.28",
                             "data.max_response_length=32", "algorithm.adv_estimator=grpo",
                             "actor_rollout_ref.rollout.n=4", "trainer.experiment_name=e1", *MODEL])
    actor = cfg.actor_rollout_ref.actor
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (0.3, 0.28)
    assert cfg.actor_rollout_ref.rollout.response_length == 32
    assert cfg.critic.enable is False and cfg.critic.model.path == "/models/m"
    assert cfg.trainer.default_local_dir == "checkpoints/megappo_examples/e1"
    assert resolve(cfg) == cfg  # idempotent


# ------------------------------------------------------------------------------------------------------------------
# overrides and recipes
# ------------------------------------------------------------------------------------------------------------------
def test_cli_values_are_typed_as_verl_users_write_them():
    cfg = load_config(None, [
        "actor_rollout_ref.actor.use_kl_loss=true", "algorithm.kl_ctrl.type=adaptive",
        "data.train_files=[a.parquet,b.parquet]", "actor_rollout_ref.actor.optim.lr=1e-6",
        "trainer.total_training_steps=5", "trainer.total_training_steps=null", "trainer.val_before_train=False",
        "+trainer.experiment_name=2024", "actor_rollout_ref.actor.entropy_coeff=0", "data.val_files=null",
        "trainer.logger=tensorboard", "actor_rollout_ref.model.override_config.num_hidden_layers=2",
        "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2",
    ])
    assert cfg.actor_rollout_ref.actor.use_kl_loss is True
    assert cfg.algorithm.kl_ctrl.type == "adaptive"
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6 and isinstance(cfg.actor_rollout_ref.actor.optim.lr, float)
    assert cfg.trainer.total_training_steps is None and cfg.trainer.val_before_train is False
    assert cfg.trainer.experiment_name == "2024"
    assert cfg.data.val_files is None and cfg.trainer.logger == ["tensorboard"]
    assert cfg.actor_rollout_ref.model.override_config == {"num_hidden_layers": 2}
    assert cfg.actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size == 2


def test_recipe_nested_and_dotted_keys_then_cli_wins(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("actor_rollout_ref:\n  actor:\n    optim: {lr: 1e-5}\n"
                      "algorithm.kl_ctrl.kl_coef: 0.01\ncritic.model.path: ${actor_rollout_ref.model.path}\n"
                      "trainer: {total_epochs: 3}\n")
    cfg = load_config(str(recipe), ["trainer.total_epochs=4", *MODEL])
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-5  # "1e-5" is a string to PyYAML
    assert cfg.algorithm.kl_ctrl.kl_coef == 0.01
    assert cfg.critic.model.path == "/models/m"
    assert cfg.trainer.total_epochs == 4


def test_unknown_key_names_the_closest_key_on_cli():
    msg = errors_of(load_config, None, ["actor_rollout_ref.actor.use_kl_los=true"])
    assert "unknown key 'actor_rollout_ref.actor.use_kl_los'" in msg
    assert "did you mean 'actor_rollout_ref.actor.use_kl_loss'" in msg
    # verl's deprecated names, keys in the wrong group, and megatron abbreviations
    for wrong, right in [("actor_rollout_ref.actor.ppo_micro_batch_size=4",
                          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
                         ("reward_model.model.path=x", "reward_model.path"),
                         ("actor_rollout_ref.kl_loss_coef=0.1", "actor_rollout_ref.actor.kl_loss_coef"),
                         ("algo.gamma=0.9", "algorithm.gamma"),
                         ("critic.megatron.tp=2", "critic.megatron.tensor_model_parallel_size")]:
        assert f"did you mean '{right}'" in errors_of(load_config, None, [wrong])


def test_unknown_key_in_recipe_names_file_and_closest_key(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("trainer:\n  gaurd:\n    kl_threshold: 2\n")
    msg = errors_of(load_config, str(recipe), [])
    assert "unknown key 'trainer.gaurd'" in msg and str(recipe) in msg
    assert "did you mean 'trainer.guard'" in msg


def test_unknown_key_without_close_match_lists_the_valid_ones():
    msg = errors_of(load_config, None, ["actor_rollout_ref.rollout.val_kwargs.zzz=1"])
    assert "valid keys under 'actor_rollout_ref.rollout.val_kwargs': n, temperature" in msg


@pytest.mark.parametrize("override, expected", [
    ("actor_rollout_ref.actor.use_kl_loss=maybe", "actor_rollout_ref.actor.use_kl_loss: expected a boolean"),
    ("data.train_batch_size=1.5", "data.train_batch_size: expected an integer"),
    ("actor_rollout_ref.actor.optim.lr=fast", "actor_rollout_ref.actor.optim.lr: expected a number"),
    ("algorithm.kl_ctrl.type=adaptiv", "algorithm.kl_ctrl.type: expected one of fixed, adaptive"),
    ("trainer.resume_mode=yes", "expected one of auto, disable, resume_path"),
    ("trainer.n_gpus_per_node=null", "trainer.n_gpus_per_node: expected an integer"),
    ("trainer.total_training_steps=x", "expected an integer or null"),
    ("trainer.logger=[console,tb]", "'tb' is not one of console, tensorboard, wandb"),
    ("algorithm.kl_ctrl=fixed", "algorithm.kl_ctrl is a group of settings"),
    ("algorithm.gamma.x=1", "algorithm.gamma is a number and has no sub-keys"),
    ("trainer", "expected key=value"),
    ("actor_rollout_ref.rollout.engine_kwargs=3", "engine_kwargs: expected a mapping"),
])
def test_wrong_type_names_key_and_expected_type(override, expected):
    assert expected in errors_of(load_config, None, [override])


def test_all_problems_reported_at_once():
    err = pytest.raises(ConfigError, load_config, None, ["a.b=1", "data.seed=x", "trainer.nnodes=y"]).value
    assert len(err.errors) == 3


def test_recipe_shape_errors(tmp_path):
    hydra = tmp_path / "hydra.yaml"
    hydra.write_text("defaults:\n  - ppo_trainer\n")
    assert "'defaults:' is a Hydra list" in errors_of(load_config, str(hydra), [])
    bad = tmp_path / "list.yaml"
    bad.write_text("- a\n- b\n")
    assert "must be a mapping" in errors_of(load_config, str(bad), [])
    assert "not found" in errors_of(load_config, str(tmp_path / "missing.yaml"), [])
    ref = tmp_path / "ref.yaml"
    ref.write_text("critic:\n  model:\n    path: ${actor_rollout_ref.model.pth}\n")
    assert "did you mean 'actor_rollout_ref.model.path'" in errors_of(load_config, str(ref), [])


def test_yaml_round_trip(tmp_path):
    cfg = load_config(None, ["algorithm.kl_ctrl.type=adaptive", "data.train_files=[a,b]", *MODEL])
    saved = tmp_path / "saved.yaml"
    saved.write_text(to_yaml(cfg))
    assert load_config(str(saved)) == cfg
    assert from_dict(yaml.safe_load(to_yaml(cfg))) == cfg


# ------------------------------------------------------------------------------------------------------------------
# validation
# ------------------------------------------------------------------------------------------------------------------
def write_model(tmp_path: Path, **hf) -> str:
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"num_attention_heads": 14, "num_key_value_heads": 2,
                                               "num_hidden_layers": 24, **hf}))
    return str(d)


def test_defaults_with_a_model_validate():
    validate(load_config(None, MODEL), world_size=8)
    preflight(load_config(None, MODEL), world_size=8)


def test_model_path_required():
    assert "actor_rollout_ref.model.path: is not set" in errors_of(preflight, load_config(), world_size=1)


def test_cross_field_rules_are_collected_with_keys_and_fixes():
    cfg = load_config(None, [
        *MODEL, "actor_rollout_ref.actor.clip_ratio_c=1.0", "algorithm.gamma=1.5", "algorithm.lam=-0.1",
        "trainer.resume_mode=resume_path", "trainer.total_epochs=0", "trainer.save_freq=0",
        "actor_rollout_ref.rollout.top_p=0",
    ])
    msg = errors_of(preflight, cfg, world_size=8)
    assert msg == errors_of(validate, cfg, world_size=8)  # all of them are the configuration's own rules
    for expected in ["actor_rollout_ref.actor.clip_ratio_c: must be > 1", "algorithm.gamma: must be in [0, 1]",
                     "algorithm.lam: must be in [0, 1]", "trainer.resume_from_path: is required when "
                     "trainer.resume_mode=resume_path", "trainer.total_epochs: must be >= 1",
                     "trainer.save_freq: must be -1 or >= 1", "actor_rollout_ref.rollout.top_p"]:
        assert expected in msg
    assert "(7 problems)" in msg


def test_parallel_sizes_against_world_size():
    cfg = load_config(None, [*MODEL, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3"])
    msg = errors_of(preflight, cfg, world_size=8)
    assert "actor_rollout_ref.actor.megatron" in msg and "world size 8 is not divisible" in msg
    cfg = load_config(None, [*MODEL, "trainer.nnodes=1", "trainer.n_gpus_per_node=6",
                             "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=4"])
    assert "world size 6" in errors_of(preflight, cfg, check_files=False)  # world from trainer.nnodes * n_gpus


def test_parallel_sizes_against_model_config_json(tmp_path):
    path = write_model(tmp_path)  # 14 heads, 2 kv heads, 24 layers, no experts
    base = [f"actor_rollout_ref.model.path={path}"]
    cases = [
        (["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4"], "does not divide num_attention_heads=14"),
        (["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
          "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=5"],
         "num_hidden_layers=24 is not divisible by pp*vpp = 10"),
        (["actor_rollout_ref.actor.megatron.expert_model_parallel_size=2"], "the model has no experts"),
        (["actor_rollout_ref.rollout.tensor_model_parallel_size=4"],
         "4 does not divide the model's num_attention_heads=14 and num_key_value_heads=2; use one of 1, 2"),
    ]
    for overrides, expected in cases:
        msg = errors_of(preflight, load_config(None, base + overrides), world_size=8)
        assert expected in msg, msg
    preflight(load_config(None, base + ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                                        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=4"]),
              world_size=8)


def test_reference_and_critic_take_the_actors_layout():
    cfg = resolve(load_config(None, ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                                     "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
                                     "actor_rollout_ref.actor.megatron.sequence_parallel=true"]))
    for meg in (cfg.actor_rollout_ref.ref.megatron, cfg.critic.megatron):
        assert (meg.tensor_model_parallel_size, meg.pipeline_model_parallel_size, meg.sequence_parallel) == (2, 2, True)
    msg = errors_of(validate, load_config(None, ["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
                                                 "critic.megatron.pipeline_model_parallel_size=4"]), world_size=8)
    assert "critic.megatron.pipeline_model_parallel_size: is 4 but the actor's is 2" in msg, msg
    assert "set it to 2 or leave it out" in msg


def test_batch_sizes_divide_each_other():
    def msg(*overrides, world=8):
        return errors_of(preflight, load_config(None, [*MODEL, *overrides]), world_size=world)

    assert "use a divisor of data.train_batch_size=1024" in msg("actor_rollout_ref.actor.ppo_mini_batch_size=300")
    # 3 prompts x 1 sample per mini-batch over dp=8 ranks
    assert "does not split over 8 data-parallel ranks" in msg("data.train_batch_size=3",
                                                              "actor_rollout_ref.actor.ppo_mini_batch_size=3")
    # 256 x 1 / dp 8 = 32 samples per rank; a micro batch of 5 does not divide it
    assert "ppo_micro_batch_size_per_gpu: 5 does not divide the per-rank mini-batch of 32" in msg(
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5")
    assert "critic.ppo_micro_batch_size_per_gpu: 5" in msg("critic.ppo_micro_batch_size_per_gpu=5")
    # dynamic batching makes the micro batch a token budget instead, which must hold one sample
    preflight(load_config(None, [*MODEL, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5",
                                 "critic.ppo_micro_batch_size_per_gpu=4",
                                 "actor_rollout_ref.actor.use_dynamic_bsz=true"]),
              world_size=8)
    assert "cannot hold one sample" in msg("actor_rollout_ref.actor.use_dynamic_bsz=true",
                                           "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=100")


def test_algorithm_and_backend_combinations():
    def msg(*overrides):
        return errors_of(validate, load_config(None, [*MODEL, *overrides]), world_size=1)

    assert "set actor_rollout_ref.rollout.n to 2 or more" in msg("algorithm.adv_estimator=grpo")
    assert "algorithm.adv_estimator=gae needs a value function" in msg("critic.enable=false")
    assert "names running servers but actor_rollout_ref.rollout.name=hf runs in the trainer's ranks" in msg(
        "actor_rollout_ref.rollout.server_urls=[http://127.0.0.1:30000]")
    assert "reward_model.path: is required" in msg("reward_model.enable=true")
    assert "data.max_response_length=64 instead" in msg("actor_rollout_ref.rollout.response_length=64")


def test_validate_accepts_an_unresolved_tree_built_in_code():
    cfg = MegappoConfig()
    cfg.actor_rollout_ref.model.path = "/models/m"
    validate(cfg, world_size=8)
    preflight(cfg, world_size=8)
    assert cfg.actor_rollout_ref.actor.clip_ratio_low is None  # neither changes its argument


def test_validate_checks_types_of_a_tree_built_in_code():
    cfg = load_config(None, MODEL)
    cfg.algorithm.kl_penalty = "bogus"
    cfg.data.train_batch_size = "8"
    msg = errors_of(validate, cfg, world_size=1)
    assert "algorithm.kl_penalty: expected one of kl, k1" in msg
    assert "data.train_batch_size: expected an integer" in msg


def test_files_checked_for_a_real_launch_only(tmp_path):
    cfg = load_config(None, [f"actor_rollout_ref.model.path={tmp_path / 'nope'}", "trainer.n_gpus_per_node=1",
                             f"data.train_files={tmp_path / 'train.parquet'}", "data.val_files=null"])
    preflight(cfg, world_size=1)  # an explicit world size is a planning check: files need not exist
    msg = errors_of(preflight, cfg)
    assert "has no config.json" in msg and "train.parquet' does not exist" in msg
    assert "has no config.json" not in errors_of(validate, cfg)  # the model is preflight's to check


def test_validate_keeps_to_the_configurations_own_rules():
    # an impossible layout and an unset model are preflight's (they need megappo.platform and the model's files)
    cfg = load_config(None, ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3"])
    validate(cfg, world_size=8)
    msg = errors_of(preflight, cfg, world_size=8)
    assert "world size 8 is not divisible" in msg and "actor_rollout_ref.model.path: is not set" in msg


def test_preflight_collects_rule_and_layout_problems_together():
    cfg = load_config(None, [*MODEL, "algorithm.gamma=2",
                             "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3"])
    err = pytest.raises(ConfigError, preflight, cfg, world_size=8).value
    assert len(err.errors) == 2 and "algorithm.gamma" in err.errors[0] and "not divisible" in err.errors[1]
    cfg.algorithm.gamma = "x"  # wrong types stop the checks at once: the rules assume well-typed values
    err = pytest.raises(ConfigError, preflight, cfg, world_size=8).value
    assert err.errors == ["algorithm.gamma: expected a number, got 'x'"]


def test_config_imports_nothing_of_megappo_outside_config():
    import subprocess
    import sys

    code = ("import megappo.config, sys; print([m for m in sys.modules if m.startswith('megappo') "
            "and not m.startswith('megappo.config') and m != 'megappo'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
    # and the trainer's preflight (what --print-config and --dry-run run) loads neither torch nor pyarrow to start
    code = ("import megappo.trainer.preflight, sys; "
            "print([m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'pyarrow')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


# ------------------------------------------------------------------------------------------------------------------
# data.synthetic: the trainer makes the model and the Parquet files
# ------------------------------------------------------------------------------------------------------------------
SYNTHETIC = ["data.synthetic.name=digit_max", "data.train_batch_size=8",
             "actor_rollout_ref.actor.ppo_mini_batch_size=4", "data.synthetic.num_train_prompts=64",
             "trainer.n_gpus_per_node=2",
             "data.max_prompt_length=16", "data.max_response_length=4"]  # within the task model's 128 positions


def test_synthetic_task_needs_no_model_or_data_files(tmp_path):
    cfg = load_config(None, [*SYNTHETIC, f"data.train_files={tmp_path / 'none.parquet'}", "data.val_files=null"])
    assert cfg.actor_rollout_ref.model.path is None
    validate(cfg)  # a real launch: files checked, yet none is needed
    preflight(cfg)
    preflight(load_config(None, [*SYNTHETIC, "data.train_files=[]"]))
    # the layout is still checked against the world size (heads and layers are unknown until the model is made)
    bad = load_config(None, [*SYNTHETIC, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4"])
    assert "world size 2 is not divisible" in errors_of(preflight, bad)
    # without the task the same tree needs both
    msg = errors_of(preflight, load_config(None, [*SYNTHETIC[1:], f"data.train_files={tmp_path / 'none.parquet'}"]))
    assert "actor_rollout_ref.model.path: is not set" in msg and "none.parquet' does not exist" in msg


def test_synthetic_task_sizes():
    msg = errors_of(validate, load_config(None, [*SYNTHETIC, "data.synthetic.num_train_prompts=4",
                                                 "data.synthetic.num_val_prompts=0",
                                                 "data.synthetic.warm_start_steps=-1"]), world_size=2)
    assert "data.synthetic.num_train_prompts: 4 prompts do not fill one step of data.train_batch_size=8" in msg
    assert "data.synthetic.num_val_prompts: must be >= 1" in msg
    assert "data.synthetic.warm_start_steps: must be >= 0" in msg
    assert "(3 problems)" in msg
    validate(load_config(None, [*SYNTHETIC, "data.synthetic.num_train_prompts=8",
                                "data.synthetic.warm_start_steps=0"]), world_size=2)
    assert "data.synthetic.name: is empty" in errors_of(validate, load_config(None, [*SYNTHETIC[1:],
                                                                                   "data.synthetic.name=''"]))
    msg = errors_of(preflight, load_config(None, [*SYNTHETIC[1:], "data.synthetic.name=digit_mx"]))
    assert "data.synthetic.name: 'digit_mx' is not a built-in task; use one of colour_square, digit_max" in msg
    # off (the default): the sizes are not checked
    validate(load_config(None, [*MODEL, "data.synthetic.num_train_prompts=0"]), world_size=8)


# ------------------------------------------------------------------------------------------------------------------
# preflight with files: Parquet schema and the custom reward function
# ------------------------------------------------------------------------------------------------------------------
def _runnable(tmp_path: Path, *overrides: str) -> MegappoConfig:
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = pa.table({"data_source": ["openai/gsm8k"],
                     "prompt": [[{"role": "user", "content": "1+1?"}]],
                     "reward_model": [{"style": "rule", "ground_truth": "2"}]})
    pq.write_table(good, tmp_path / "train.parquet")
    pq.write_table(good, tmp_path / "test.parquet")
    model = write_model(tmp_path, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    return load_config("gsm8k/tiny_cpu", [f"actor_rollout_ref.model.path={model}",
                                          f"data.train_files={tmp_path / 'train.parquet'}",
                                          f"data.val_files={tmp_path / 'test.parquet'}", *overrides])


def test_preflight_reads_the_parquet_schema(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    preflight(_runnable(tmp_path))
    pq.write_table(pa.table({"question": ["q"], "answer": ["a"]}), tmp_path / "raw.parquet")
    (tmp_path / "empty.parquet").write_bytes(b"")
    msg = errors_of(preflight, _runnable(tmp_path, f"data.train_files=[{tmp_path / 'raw.parquet'}]",
                                         f"data.val_files={tmp_path / 'empty.parquet'}"))
    assert "data.train_files: " in msg and "raw.parquet, column 'prompt': missing column" in msg
    assert "data.val_files: " in msg and "the file is empty" in msg and "Fix: " in msg
    assert "(2 problems)" in msg
    preflight(_runnable(tmp_path, f"data.train_files=[{tmp_path / 'raw.parquet'}]"), world_size=1)  # planning only


def test_preflight_imports_the_custom_reward_function(tmp_path):
    good = tmp_path / "reward.py"
    good.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    preflight(_runnable(tmp_path, f"custom_reward_function.path={good}"))
    msg = errors_of(preflight, _runnable(tmp_path, f"custom_reward_function.path={good}",
                                         "custom_reward_function.name=score"))
    assert "custom_reward_function.name: " in msg and "defines no 'score'" in msg and "compute_score" in msg
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    msg = errors_of(preflight, _runnable(tmp_path, f"custom_reward_function.path={broken}"))
    assert "custom_reward_function.path: importing" in msg and "ModuleNotFoundError" in msg and "fix the file" in msg
    missing = _runnable(tmp_path, f"custom_reward_function.path={tmp_path}/no.py")
    assert "is not a file" in errors_of(preflight, missing)


# ------------------------------------------------------------------------------------------------------------------
# recipes
# ------------------------------------------------------------------------------------------------------------------
RECIPES = bundled_recipes()  # every recipe under recipes/, any depth, by its --config name
# the real models' head, layer and expert counts (their config.json), so the GPU recipes' layouts are checked too
MODEL_DIMS = {
    "Qwen2.5-0.5B-Instruct": dict(num_attention_heads=14, num_key_value_heads=2, num_hidden_layers=24),
    "Qwen2.5-7B-Instruct": dict(num_attention_heads=28, num_key_value_heads=4, num_hidden_layers=28),
    "Qwen2.5-7B": dict(num_attention_heads=28, num_key_value_heads=4, num_hidden_layers=28),  # the base model
    "Qwen3-8B": dict(num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=36),
    "Qwen3-1.7B": dict(num_attention_heads=16, num_key_value_heads=8, num_hidden_layers=28),
    "Qwen3-30B-A3B": dict(num_attention_heads=32, num_key_value_heads=4, num_hidden_layers=48, num_experts=128),
}


def test_the_recipes_exist():
    assert {"gsm8k/tiny_cpu", "gsm8k/qwen2.5-0.5b_ppo", "gsm8k/qwen3-8b_ppo_tp2", "gsm8k/qwen2.5-7b_ppo_tp4pp2",
            "gsm8k/qwen3-30b-a3b_grpo_ep8"} <= set(RECIPES)
    assert not list(RECIPES_DIR.glob("*.yaml")), "recipes live in recipes/<task>/"


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_loads_and_validates_at_its_world_size(name, tmp_path):
    path = RECIPES[name]
    text = path.read_text(encoding="utf-8")
    assert text.startswith("#") and "Launch" in text and "Edit" in text, "a recipe starts with what/launch/edit"
    cfg = load_config(str(path))
    world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    preflight(cfg, world, check_files=False)
    assert load_config(name) == cfg  # --config NAME finds the bundled recipe
    model = Path(cfg.actor_rollout_ref.model.path or "").name
    if model in MODEL_DIMS:  # the layout against the real model's shape
        real = write_model(tmp_path, **MODEL_DIMS[model])
        preflight(load_config(str(path), [f"actor_rollout_ref.model.path={real}"]), world, check_files=False)


def test_gpu_recipes_use_the_layouts_they_name():
    def meg(name, role="actor_rollout_ref.actor"):
        return get(load_config(name), f"{role}.megatron")

    small = load_config("gsm8k/qwen2.5-0.5b_ppo")
    a = small.actor_rollout_ref.actor
    d = small.data
    assert (d.train_batch_size, d.max_prompt_length, d.max_response_length) == (1024, 512, 512)
    o = a.optim
    assert (o.lr, o.lr_scheduler, o.lr_warmup_steps_ratio, o.clip_grad) == (1e-6, "cosine", 0.1, 1.0)
    assert (a.clip_ratio, a.clip_ratio_c, a.ppo_mini_batch_size, a.ppo_micro_batch_size_per_gpu) == (0.2, 3.0, 256, 8)
    assert a.use_dynamic_bsz and a.ppo_max_token_len_per_gpu == 16384
    alg = small.algorithm
    assert (alg.gamma, alg.lam, alg.use_kl_in_reward) == (1.0, 0.95, True)
    kl = alg.kl_ctrl
    assert (kl.type, kl.kl_coef, kl.target_kl, kl.horizon) == ("adaptive", 0.001, 0.1, 10000)
    r = small.actor_rollout_ref.rollout
    assert (r.name, r.tensor_model_parallel_size, r.gpu_memory_utilization) == ("sglang", 2, 0.5)
    assert (small.trainer.nnodes, small.trainer.n_gpus_per_node) == (1, 8)
    assert small.actor_rollout_ref.model.path == "~/models/Qwen2.5-0.5B-Instruct"

    name = "gsm8k/qwen2.5-7b_ppo_tp4pp2"
    for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic"):
        m = meg(name, role)
        assert (m.tensor_model_parallel_size, m.pipeline_model_parallel_size) == (4, 2), role
    cfg = load_config(name)
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (2, 8)
    assert cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == 4

    name = "gsm8k/qwen3-30b-a3b_grpo_ep8"
    cfg = load_config(name)
    assert meg(name).expert_model_parallel_size == meg(name, "actor_rollout_ref.ref").expert_model_parallel_size == 8
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.actor_rollout_ref.rollout.n == 5 and cfg.critic.enable is False
    assert cfg.actor_rollout_ref.actor.use_kl_loss and cfg.actor_rollout_ref.actor.kl_loss_type == "low_var_kl"
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (4, 8)


def test_recipe_names_find_subfolders(tmp_path):
    tiny = RECIPES_DIR / "gsm8k" / "tiny_cpu.yaml"
    for name in ("gsm8k/tiny_cpu", "gsm8k/tiny_cpu.yaml", "recipes/gsm8k/tiny_cpu.yaml", "tiny_cpu"):
        assert find_recipe(name).resolve() == tiny, name
    local = tmp_path / "mine.yaml"
    local.write_text("trainer: {total_epochs: 2}\n")
    assert find_recipe(str(local)) == local
    msg = errors_of(find_recipe, "gsm8k/nope")
    assert "recipe file 'gsm8k/nope' not found" in msg and "gsm8k/tiny_cpu" in msg


def test_tiny_cpu_recipe_is_tiny():
    cfg = load_config("gsm8k/tiny_cpu")
    assert cfg.trainer.device == "cpu" and cfg.actor_rollout_ref.rollout.name == "hf"
    assert cfg.actor_rollout_ref.rollout.response_length == 32 and cfg.trainer.total_training_steps == 2
    assert cfg.actor_rollout_ref.actor.megatron.tensor_model_parallel_size == 1
    assert cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node == 1
    assert load_config("gsm8k/tiny_cpu", ["data.train_files=/x.parquet"]).data.train_files == "/x.parquet"


def test_estimator_and_loss_names_come_from_the_registries():
    def msg(*overrides):
        return errors_of(validate, load_config(None, [*MODEL, *overrides]), world_size=1)

    assert "did you mean 'rloo'" in msg("algorithm.adv_estimator=rlo", "actor_rollout_ref.rollout.n=4")
    assert "did you mean 'gspo'" in msg("actor_rollout_ref.actor.policy_loss.loss_mode=gpso")
    assert "algorithm.adv_estimator=rloo compares responses" in msg("algorithm.adv_estimator=rloo")
    assert "scores a greedy response" in msg("algorithm.adv_estimator=remax", "async_training.mode=one_step_off")
    for name, critic in (("gae", True), ("reinforce_plus_plus", False), ("remax", False)):
        assert load_config(None, [*MODEL, f"algorithm.adv_estimator={name}"]).critic.enable is critic
    assert "is not a file" in msg("algorithm.adv_estimator=mine", "algorithm.custom_adv_estimator.path=/nonexistent.py",
                                  "algorithm.custom_adv_estimator.name=mine")


def _rule_messages(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        validate(load_config(None, [*MODEL, *overrides]), world_size=8)
    return str(info.value)


def test_sapo_refuses_a_loss_agg_mode_it_would_ignore():
    msg = _rule_messages("actor_rollout_ref.actor.policy_loss.loss_mode=sapo", "algorithm.adv_estimator=grpo",
                         "actor_rollout_ref.rollout.n=4")
    assert "actor_rollout_ref.actor.loss_agg_mode: is token-mean" in msg and "seq-mean-token-mean" in msg
    validate(load_config(None, [*MODEL, "actor_rollout_ref.actor.policy_loss.loss_mode=sapo",
                                "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"]), world_size=8)


def test_custom_loss_without_a_name_says_to_set_the_name(tmp_path):
    path = tmp_path / "loss.py"
    path.write_text("def my_loss(*a, **k):\n    pass\n")
    msg = _rule_messages(f"actor_rollout_ref.actor.policy_loss.path={path}")
    assert "policy_loss.name: is not set" in msg and "loss_mode to that same name" in msg
    assert "=None" not in msg


def test_dro_needs_its_beta_and_estimators_say_what_they_need():
    assert "policy_loss.dro_beta: is None" in _rule_messages("actor_rollout_ref.actor.policy_loss.loss_mode=dro")
    validate(load_config(None, [*MODEL, "actor_rollout_ref.actor.policy_loss.loss_mode=dro",
                                "actor_rollout_ref.actor.policy_loss.dro_beta=0.1"]), world_size=8)
    group = ["actor_rollout_ref.rollout.n=4"]
    assert "algorithm.gdpo_reward_keys: is None" in _rule_messages("algorithm.adv_estimator=gdpo", *group)
    assert "2 weights for 1 gdpo_reward_keys" in _rule_messages(
        "algorithm.adv_estimator=gdpo", *group, "algorithm.gdpo_reward_keys=[acc]",
        "algorithm.gdpo_reward_weights=[1,2]")
    validate(load_config(None, [*MODEL, "algorithm.adv_estimator=gdpo", *group,
                                "algorithm.gdpo_reward_keys=[acc,format]"]), world_size=8)
    for name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        validate(load_config(None, [*MODEL, f"algorithm.adv_estimator={name}", *group]), world_size=8)
        validate(load_config(None, [*MODEL, f"algorithm.adv_estimator={name}", *group,
                                    "algorithm.rollout_correction.preset=decoupled_token_is"]), world_size=8)
        assert "bypass_mode: is true" in _rule_messages(f"algorithm.adv_estimator={name}", *group,
                                                        "algorithm.rollout_correction.preset=bypass_pg_is")
        assert "compares responses within a prompt's group" in _rule_messages(f"algorithm.adv_estimator={name}")
    for name in ("grpo_vectorized", "rloo_vectorized"):
        validate(load_config(None, [*MODEL, f"algorithm.adv_estimator={name}", *group]), world_size=8)


def test_rollout_correction_preset_and_explicit_keys():
    rc = load_config(None, [*MODEL, "algorithm.rollout_correction.preset=decoupled_k3_rs_token_tis",
                            "algorithm.rollout_correction.rollout_rs_threshold=0.05"]).algorithm.rollout_correction
    assert (rc.rollout_is, rc.rollout_is_threshold, rc.rollout_rs, rc.rollout_rs_threshold, rc.bypass_mode) == (
        "token", 2.0, "seq_mean_k3", "0.05", False)  # a Union[float, str] key keeps the command line's text
    recipe = {"algorithm": {"rollout_correction": {"preset": "bypass_pg_is", "rollout_is": "token"}}}
    rc = load_config(recipe, MODEL).algorithm.rollout_correction
    assert (rc.rollout_is, rc.bypass_mode, rc.loss_type) == ("token", True, "reinforce")
    cfg = load_config(recipe, MODEL)
    assert from_dict(to_dict(cfg)).algorithm.rollout_correction == cfg.algorithm.rollout_correction
    validate(cfg, world_size=8)
    with pytest.raises(ConfigError, match="did you mean 'decoupled_geo_rs'"):
        load_config(None, [*MODEL, "algorithm.rollout_correction.preset=decoupled_geo"])
