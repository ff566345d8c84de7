"""The configuration's own rules: types, and the ranges and cross-field rules that need no other package.

Each message names the key, what is wrong and the fix. These rules read nothing but the tree (and, with
check_files, whether the named paths exist). The rules of what a capability supports live beside it (`checks.py`
in algos, models.layout, models.lora, rollout, distill); `megappo.checks` runs them all as one table.
"""
from __future__ import annotations

import copy
import importlib.util
import os
from pathlib import Path
from typing import Optional

from megappo.config.fields import check_type, iter_leaves, need as _need, type_name
from megappo.config.derived import LAYOUT_KEYS, resolve
from megappo.config.schema import MegappoConfig, OptimConfig


def plan(cfg: MegappoConfig, world_size: Optional[int] = None,
         check_files: Optional[bool] = None) -> tuple[MegappoConfig, int, bool]:
    """A resolved copy of `cfg` (the argument is not changed), the world size and whether to check files:
    world_size None means `trainer.nnodes * trainer.n_gpus_per_node` (a real launch), and check_files None means
    only for a real launch, so a recipe can be checked on a machine that has none of its files."""
    cfg = resolve(copy.deepcopy(cfg))  # a tree built in code may not have its derived defaults filled yet
    if check_files is None:
        check_files = world_size is None
    if world_size is None:
        world_size = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    return cfg, world_size, check_files


def type_errors(cfg: MegappoConfig) -> list[str]:
    """Every leaf whose value is not of its field's type (the other rules assume well-typed values)."""
    return [f"{key}: expected {type_name(tp)}, got {value!r}" for key, value, tp, _ in iter_leaves(cfg)
            if not check_type(value, tp)]


def config_errors(cfg: MegappoConfig, check_files: bool = False) -> list[str]:
    """Every violation of the rules that read the tree alone (ranges, cross-field rules, named files)."""
    errors: list[str] = []
    _check_trainer(cfg, errors)
    _check_algorithm(cfg, errors)
    _check_data(cfg, errors, check_files)
    _check_actor(cfg, errors)
    _check_layouts(cfg, errors)
    _check_rollout(cfg, errors)
    _check_rewards(cfg, errors, check_files)
    _check_dapo(cfg, errors)
    for prefix, optim in (("actor_rollout_ref.actor.optim", cfg.actor_rollout_ref.actor.optim),
                          ("critic.optim", cfg.critic.optim)):
        _check_optim(prefix, optim, errors)
    return errors


def uses_synthetic_task(cfg: MegappoConfig) -> bool:
    """Whether the trainer makes the model and the Parquet files itself (data.synthetic.name is set): then
    actor_rollout_ref.model.path, data.train_files and data.val_files need not be set or exist."""
    return cfg.data.synthetic.name is not None


def _check_trainer(cfg: MegappoConfig, errors: list[str]) -> None:
    t = cfg.trainer
    _need(errors, t.nnodes >= 1, "trainer.nnodes", f"must be >= 1, got {t.nnodes}", "set it to the node count")
    _need(errors, t.n_gpus_per_node >= 1, "trainer.n_gpus_per_node", f"must be >= 1, got {t.n_gpus_per_node}",
          "set it to the ranks per node")
    _need(errors, t.total_epochs >= 1, "trainer.total_epochs", f"must be >= 1, got {t.total_epochs}",
          "use total_training_steps to stop earlier")
    _need(errors, t.total_training_steps is None or t.total_training_steps >= 1, "trainer.total_training_steps",
          f"must be >= 1 or null, got {t.total_training_steps}", "use null to run total_epochs")
    for key in ("save_freq", "test_freq"):
        value = getattr(t, key)
        _need(errors, value == -1 or value >= 1, f"trainer.{key}", f"must be -1 or >= 1, got {value}",
              "use -1 to turn it off")
    _need(errors, t.critic_warmup >= 0, "trainer.critic_warmup", f"must be >= 0, got {t.critic_warmup}", "use 0")
    _need(errors, t.log_val_generations >= 0, "trainer.log_val_generations",
          f"must be >= 0, got {t.log_val_generations}", "use 0 to log none")
    _need(errors, t.max_ckpt_to_keep is None or t.max_ckpt_to_keep >= 1, "trainer.max_ckpt_to_keep",
          f"must be >= 1 or null, got {t.max_ckpt_to_keep}", "use null to keep every checkpoint")
    _need(errors, t.resume_mode != "resume_path" or bool(t.resume_from_path), "trainer.resume_from_path",
          "is required when trainer.resume_mode=resume_path", "set it to a checkpoint directory, or use "
          "trainer.resume_mode=auto")
    _need(errors, "wandb" not in t.logger or importlib.util.find_spec("wandb") is not None, "trainer.logger",
          "includes wandb but the wandb package is not installed", "pip install wandb, or drop it from the list")
    _need(errors, bool(t.project_name) and bool(t.experiment_name), "trainer.project_name/experiment_name",
          "must not be empty", "name the run")
    g = t.guard
    for key in ("kl_threshold", "lr_factor", "kl_coef_factor", "clip_ratio_factor"):
        _need(errors, getattr(g, key) > 0, f"trainer.guard.{key}", f"must be > 0, got {getattr(g, key)}",
              f"use the default {getattr(type(g)(), key)}, or trainer.guard.enable=false")
    _need(errors, g.epoch_kl_stop is None or g.epoch_kl_stop > 0, "trainer.guard.epoch_kl_stop",
          f"must be > 0 or null, got {g.epoch_kl_stop}", "use e.g. 0.05, or null to run every PPO epoch")
    _need(errors, g.max_retries >= 0, "trainer.guard.max_retries", f"must be >= 0, got {g.max_retries}",
          "use e.g. 3 (0: stop at the first tripped step)")
    if t.save_before_deadline is not None:
        from megappo.config.deadline import deadline_refusal

        refusal = deadline_refusal(t.save_before_deadline, environ={"SLURM_JOB_END_TIME": "0"})
        errors += [refusal] if refusal else []
    rm = cfg.reward_model
    _need(errors, 0.0 <= rm.max_failure_fraction <= 1.0, "reward_model.max_failure_fraction",
          f"must be in [0, 1], got {rm.max_failure_fraction}", "use e.g. 0.5 (1.0: never stop)")
    _need(errors, rm.max_failure_steps >= 1, "reward_model.max_failure_steps",
          f"must be >= 1, got {rm.max_failure_steps}", "use e.g. 3")


def _check_algorithm(cfg: MegappoConfig, errors: list[str]) -> None:
    alg, kl = cfg.algorithm, cfg.algorithm.kl_ctrl
    for key in ("gamma", "lam"):
        value = getattr(alg, key)
        _need(errors, 0.0 <= value <= 1.0, f"algorithm.{key}", f"must be in [0, 1], got {value}",
              "use 1.0 for undiscounted LLM rewards")
    _need(errors, kl.kl_coef >= 0, "algorithm.kl_ctrl.kl_coef", f"must be >= 0, got {kl.kl_coef}", "use e.g. 0.001")
    _need(errors, kl.target_kl > 0, "algorithm.kl_ctrl.target_kl", f"must be > 0, got {kl.target_kl}", "use e.g. 0.1")
    _need(errors, kl.horizon > 0, "algorithm.kl_ctrl.horizon", f"must be > 0, got {kl.horizon}", "use e.g. 10000")


def _check_data(cfg: MegappoConfig, errors: list[str], check_files: bool) -> None:
    d = cfg.data
    for key in ("max_prompt_length", "max_response_length", "train_batch_size"):
        value = getattr(d, key)
        _need(errors, value >= 1, f"data.{key}", f"must be >= 1, got {value}", "use a positive size")
    _need(errors, d.val_batch_size is None or d.val_batch_size >= 1, "data.val_batch_size",
          f"must be >= 1 or null, got {d.val_batch_size}", "use null for the whole validation set")
    if uses_synthetic_task(cfg):
        _check_synthetic(cfg, errors)
        return  # the trainer writes the files and points data.train_files/val_files at them
    for key in ("train_files", "val_files"):
        files = getattr(d, key)
        files = [files] if isinstance(files, str) else list(files or [])
        if key == "train_files":
            _need(errors, bool(files) and all(files), "data.train_files", "is empty",
                  "set data.train_files=PATH.parquet or [a.parquet,b.parquet]")
        if check_files:
            for f in files:
                if not Path(os.path.expanduser(f)).exists():
                    from megappo.data.errors import converter_hint  # dependency-free: no torch for the config's checks

                    errors.append(f"data.{key}: '{f}' does not exist; {converter_hint(f)}")


def _check_synthetic(cfg: MegappoConfig, errors: list[str]) -> None:
    syn, p, train = cfg.data.synthetic, "data.synthetic", cfg.data.train_batch_size
    _need(errors, bool(syn.name), f"{p}.name", "is empty", f"name a task, or use {p}.name=null to read Parquet files")
    _need(errors, syn.num_train_prompts >= train, f"{p}.num_train_prompts",
          f"{syn.num_train_prompts} prompts do not fill one step of data.train_batch_size={train}",
          f"set it to at least {train}, or lower data.train_batch_size")
    _need(errors, syn.num_val_prompts >= 1, f"{p}.num_val_prompts", f"must be >= 1, got {syn.num_val_prompts}",
          "use e.g. 64")
    _need(errors, syn.warm_start_steps >= 0, f"{p}.warm_start_steps", f"must be >= 0, got {syn.warm_start_steps}",
          "use 0 to start RL from the random model")


def _check_layouts(cfg: MegappoConfig, errors: list[str]) -> None:
    """The reference and the critic run in the actor's parallel layout (one layout per process)."""
    actor = cfg.actor_rollout_ref.actor.megatron
    for prefix, meg in (("actor_rollout_ref.ref.megatron", cfg.actor_rollout_ref.ref.megatron),
                        ("critic.megatron", cfg.critic.megatron)):
        for key in LAYOUT_KEYS:
            mine, theirs = getattr(meg, key), getattr(actor, key)
            _need(errors, mine == theirs, f"{prefix}.{key}", f"is {mine} but the actor's is {theirs}: the reference "
                  "and the critic run in the actor's parallel layout", f"set it to {theirs} or leave it out")


def _check_actor(cfg: MegappoConfig, errors: list[str]) -> None:
    a, p = cfg.actor_rollout_ref.actor, "actor_rollout_ref.actor"
    _need(errors, a.clip_ratio > 0, f"{p}.clip_ratio", f"must be > 0, got {a.clip_ratio}", "use e.g. 0.2")
    low, high = a.clip_ratio_low, a.clip_ratio_high
    _need(errors, low is None or 0 < low < 1, f"{p}.clip_ratio_low", f"must be in (0, 1), got {low}",
          "use e.g. 0.2 (the ratio is clipped at 1 - clip_ratio_low)")
    _need(errors, high is None or high > 0, f"{p}.clip_ratio_high", f"must be > 0, got {high}", "use e.g. 0.28")
    _need(errors, a.clip_ratio_c > 1, f"{p}.clip_ratio_c", f"must be > 1 (dual-clip bound), got {a.clip_ratio_c}",
          "use e.g. 3.0")
    _need(errors, a.kl_loss_coef >= 0, f"{p}.kl_loss_coef", f"must be >= 0, got {a.kl_loss_coef}", "use e.g. 0.001")
    _need(errors, a.ppo_epochs >= 1, f"{p}.ppo_epochs", f"must be >= 1, got {a.ppo_epochs}", "use 1")
    _need(errors, cfg.critic.ppo_epochs is None or cfg.critic.ppo_epochs >= 1, "critic.ppo_epochs",
          f"must be >= 1, got {cfg.critic.ppo_epochs}", "use 1")
    _need(errors, cfg.critic.cliprange_value > 0, "critic.cliprange_value",
          f"must be > 0, got {cfg.critic.cliprange_value}", "use e.g. 0.5")
    seq_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    for key, dynamic, budget in (
        (f"{p}.ppo_max_token_len_per_gpu", a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu),
        ("critic.ppo_max_token_len_per_gpu", cfg.critic.enable and cfg.critic.use_dynamic_bsz,
         cfg.critic.ppo_max_token_len_per_gpu),
    ):
        _need(errors, not dynamic or budget >= seq_len, key, f"{budget} tokens cannot hold one sample of "
              f"data.max_prompt_length + data.max_response_length = {seq_len}", f"set it to at least {seq_len}")


def _check_rollout(cfg: MegappoConfig, errors: list[str]) -> None:
    r, p, d = cfg.actor_rollout_ref.rollout, "actor_rollout_ref.rollout", cfg.data
    _need(errors, r.n >= 1, f"{p}.n", f"must be >= 1, got {r.n}", "use 1 for PPO, more for GRPO")
    for prefix, temperature, top_p, top_k, n in ((p, r.temperature, r.top_p, r.top_k, r.n),
                                                 (f"{p}.val_kwargs", r.val_kwargs.temperature, r.val_kwargs.top_p,
                                                  r.val_kwargs.top_k, r.val_kwargs.n)):
        _need(errors, temperature >= 0, f"{prefix}.temperature", f"must be >= 0, got {temperature}",
              "use 1.0 (0 is greedy)")
        _need(errors, 0 < top_p <= 1, f"{prefix}.top_p", f"must be in (0, 1], got {top_p}", "use 1.0 for no top-p")
        _need(errors, top_k >= -1, f"{prefix}.top_k", f"must be -1 or >= 0, got {top_k}", "use -1 for no top-k")
        _need(errors, n >= 1, f"{prefix}.n", f"must be >= 1, got {n}", "use 1")
    _need(errors, 0 < r.gpu_memory_utilization <= 1, f"{p}.gpu_memory_utilization",
          f"must be in (0, 1], got {r.gpu_memory_utilization}", "use e.g. 0.5")
    for key in ("max_num_batched_tokens", "max_num_seqs", "tensor_model_parallel_size"):
        value = getattr(r, key)
        _need(errors, value >= 1, f"{p}.{key}", f"must be >= 1, got {value}", "use a positive size")
    for key, mine, data_key in (("prompt_length", r.prompt_length, "max_prompt_length"),
                                ("response_length", r.response_length, "max_response_length")):
        theirs = getattr(d, data_key)
        _need(errors, mine is None or mine == theirs, f"{p}.{key}", f"is {mine} but data.{data_key} is {theirs}",
              f"set data.{data_key}={mine} instead (the rollout length follows it)")
    total = d.max_prompt_length + d.max_response_length
    _need(errors, r.max_model_len is None or r.max_model_len >= total, f"{p}.max_model_len",
          f"{r.max_model_len} is shorter than prompt + response = {total}", f"set it to >= {total} or null")
    _need(errors, not (r.api_key or "").startswith("-"), f"{p}.api_key", "starts with '-', which SGLang's argument "
          "parser reads as a flag", "choose a key that starts with a letter or digit (or null for a random one)")
    _need(errors, not (r.api_key and r.api_key_file), f"{p}.api_key_file",
          f"is set together with {p}.api_key", "set one of them")
    _need(errors, r.servers_per_node is None or r.servers_per_node >= 1, f"{p}.servers_per_node",
          f"must be >= 1 or null, got {r.servers_per_node}", "use null for one per tensor_model_parallel_size GPUs")
    for key in ("server_start_timeout_s", "request_timeout_s", "sync_timeout_s", "health_check_interval_s",
                "health_check_timeout_s"):
        _need(errors, getattr(r, key) > 0, f"{p}.{key}", f"must be > 0, got {getattr(r, key)}", "use seconds, e.g. 60")
    _need(errors, r.weight_sync_bucket_mb >= 1, f"{p}.weight_sync_bucket_mb",
          f"must be >= 1, got {r.weight_sync_bucket_mb}", "use e.g. 512")
    _need(errors, r.verify_sync_atol is None or r.verify_sync_atol > 0, f"{p}.verify_sync_atol",
          f"must be > 0 or null, got {r.verify_sync_atol}", "use null for the dtype's default")
    for key in (f"{p}.log_prob_micro_batch_size_per_gpu", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "critic.ppo_micro_batch_size_per_gpu",
                "reward_model.micro_batch_size_per_gpu"):
        value = _lookup(cfg, key)
        _need(errors, value is None or value >= 1, key, f"must be >= 1 or null, got {value}",
              "use null for the whole local batch")


def _check_rewards(cfg: MegappoConfig, errors: list[str], check_files: bool) -> None:
    rm, crf = cfg.reward_model, cfg.custom_reward_function
    _need(errors, not rm.enable or bool(rm.path), "reward_model.path", "is required when reward_model.enable=true",
          "set reward_model.path=MODEL_DIR or reward_model.enable=false")
    _need(errors, rm.num_workers >= 1, "reward_model.num_workers", f"must be >= 1, got {rm.num_workers}",
          "use e.g. 2")
    _need(errors, rm.timeout_s > 0, "reward_model.timeout_s", f"must be > 0, got {rm.timeout_s}", "use e.g. 30")
    _need(errors, crf.name.isidentifier(), "custom_reward_function.name", f"'{crf.name}' is not a Python name",
          "set it to the function's name, e.g. compute_score")
    if check_files and crf.path:
        _need(errors, Path(os.path.expanduser(crf.path)).is_file(), "custom_reward_function.path",
              f"'{crf.path}' is not a file", "point it at the .py file that defines the function")
    if check_files and rm.enable and rm.path:
        _need(errors, Path(os.path.expanduser(rm.path)).exists(), "reward_model.path", f"'{rm.path}' does not exist",
              "point it at the reward model directory")
    t = cfg.trainer
    if check_files and t.resume_mode == "resume_path" and t.resume_from_path:
        _need(errors, Path(os.path.expanduser(t.resume_from_path)).exists(), "trainer.resume_from_path",
              f"'{t.resume_from_path}' does not exist", "point it at a checkpoint directory")


def _check_dapo(cfg: MegappoConfig, errors: list[str]) -> None:
    """algorithm.filter_groups, data.gen_batch_size and reward_model.overlong_buffer (DAPO)."""
    fg, d, ob = cfg.algorithm.filter_groups, cfg.data, cfg.reward_model.overlong_buffer
    gen = d.gen_batch_size if d.gen_batch_size is not None else d.train_batch_size
    _need(errors, gen >= 1, "data.gen_batch_size", f"must be >= 1 or null, got {gen}",
          "use null for data.train_batch_size")
    _need(errors, fg.enable or gen == d.train_batch_size, "data.gen_batch_size",
          f"is {gen} but data.train_batch_size is {d.train_batch_size}, and only algorithm.filter_groups trims a "
          "generation batch to the train batch", "set data.gen_batch_size=null, or algorithm.filter_groups.enable=true")
    if fg.enable:
        n = cfg.actor_rollout_ref.rollout.n
        _need(errors, n > 1, "algorithm.filter_groups.enable", f"needs groups to filter but actor_rollout_ref."
              f"rollout.n is {n}", "set actor_rollout_ref.rollout.n to 2 or more (DAPO: 16)")
        _need(errors, cfg.async_training.mode == "sync", "algorithm.filter_groups.enable",
              f"is not supported with async_training.mode={cfg.async_training.mode} (a step's generation batches "
              "depend on the scores of the ones before)", "set async_training.mode=sync, or "
              "algorithm.filter_groups.enable=false")
        _need(errors, not cfg.reward_model.enable, "algorithm.filter_groups.enable",
              "filters on rule rewards, but reward_model.enable=true scores with a model after the rollout phase",
              "set reward_model.enable=false (rule rewards), or algorithm.filter_groups.enable=false")
        _need(errors, bool(fg.metric), "algorithm.filter_groups.metric", "is empty",
              "use reward (verl's default), acc, score or a numeric key the reward function returns")
        _need(errors, fg.metric != "seq_final_reward" or not cfg.algorithm.use_kl_in_reward,
              "algorithm.filter_groups.metric", "seq_final_reward includes the in-reward KL, which is computed after "
              "the rollout phase", "use reward (the score before the KL), or algorithm.use_kl_in_reward=false")
    if ob.enable:
        _need(errors, 0 < ob.len <= d.max_response_length, "reward_model.overlong_buffer.len",
              f"must be in (0, data.max_response_length={d.max_response_length}], got {ob.len}",
              "use e.g. a fifth of max_response_length (DAPO: 4096 of 20480)")
        _need(errors, ob.penalty_factor >= 0, "reward_model.overlong_buffer.penalty_factor",
              f"must be >= 0, got {ob.penalty_factor}", "use e.g. 1.0")
        _need(errors, not cfg.reward_model.enable, "reward_model.overlong_buffer.enable",
              "shapes rule rewards, but reward_model.enable=true", "set one of them to false")


def _check_optim(prefix: str, o: OptimConfig, errors: list[str]) -> None:
    _need(errors, o.lr >= 0, f"{prefix}.lr", f"must be >= 0, got {o.lr}", "use e.g. 1e-6")
    _need(errors, o.weight_decay >= 0, f"{prefix}.weight_decay", f"must be >= 0, got {o.weight_decay}", "use 0.01")
    _need(errors, o.clip_grad > 0, f"{prefix}.clip_grad", f"must be > 0, got {o.clip_grad}", "use 1.0")
    _need(errors, 0 <= o.lr_warmup_steps_ratio <= 1, f"{prefix}.lr_warmup_steps_ratio",
          f"must be in [0, 1], got {o.lr_warmup_steps_ratio}", "use e.g. 0.0 or 0.05")
    _need(errors, 0 <= o.min_lr_ratio <= 1, f"{prefix}.min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio}",
          "use e.g. 0.0 or 0.1")
    _need(errors, len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), f"{prefix}.betas",
          f"must be two numbers in [0, 1), got {o.betas}", "use [0.9, 0.999]")


def _lookup(cfg: MegappoConfig, key: str):
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node
