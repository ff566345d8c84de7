"""Everything `megappo train` checks before any rank starts work, every problem collected into one ConfigError.

`preflight(cfg)` runs the configuration's own rules (`megappo.config.validate`) and then the checks that need the
rest of megappo: each role's parallel layout against the world size and the model's head, layer and expert counts
(read from `<model.path>/config.json` when it is there), the rollout's tensor-parallel size, and how batches split
into mini- and micro-batches over data-parallel ranks. With check_files it also reads the schema of every Parquet
file and imports the custom reward function. With data.synthetic.name set, the trainer writes the model and the
Parquet files itself: the task must exist, and neither is read. Each message names the key, what is wrong and the fix.

Light to import: no torch, megatron or pyarrow until a check needs them.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megappo.config import ConfigError, MegappoConfig
from megappo.config.validate import plan, rule_errors, uses_synthetic_task
from megappo.platform.layout import LayoutError, ParallelLayout, check_layout


@dataclass(frozen=True)
class ModelDims:
    num_attention_heads: Optional[int] = None
    num_key_value_heads: Optional[int] = None
    num_layers: Optional[int] = None
    num_experts: Optional[int] = None  # 0 when config.json was read and names no experts


def preflight(cfg: MegappoConfig, world_size: Optional[int] = None, *, check_files: Optional[bool] = None) -> None:
    """Raise ConfigError listing every problem that would stop a run of `cfg` (`cfg` itself is not changed).

    world_size: ranks the run will have; None means `trainer.nnodes * trainer.n_gpus_per_node` (a real launch).
    check_files: whether the model, data, reward and checkpoint paths must exist and be readable (Parquet schema,
    custom reward function import); by default only for a real launch (world_size None), so a recipe can be
    checked on a machine that has none of its files.
    With data.synthetic.name set the trainer makes the model and the Parquet files, so neither is checked.
    """
    errors = rule_errors(cfg, world_size, check_files=check_files)  # raises at once on wrong types
    cfg, world_size, check_files = plan(cfg, world_size, check_files)
    if cfg.data.synthetic.name:
        _check_synthetic_task(cfg.data.synthetic.name, errors)
    if world_size >= 1:
        _check_parallel_and_batches(cfg, world_size, errors, check_files)
    if check_files:
        _check_api_key_file(cfg.actor_rollout_ref.rollout.api_key_file, errors)
        if not uses_synthetic_task(cfg):
            _check_parquet_schemas(cfg, errors)
        _check_custom_reward_function(cfg, errors)
    if errors:
        raise ConfigError(errors)


def _need(errors: list[str], ok: bool, key: str, problem: str, fix: str) -> None:
    if not ok:
        errors.append(f"{key}: {problem}; {fix}")


# ------------------------------------------------------------------------------------------------------------------
# parallel layout and batch divisibility
# ------------------------------------------------------------------------------------------------------------------
def read_model_dims(path: Optional[str]) -> Optional[ModelDims]:
    """Head, layer and expert counts from a Hugging Face config.json; None when there is none to read."""
    if not path:
        return None
    file = Path(os.path.expanduser(path)) / "config.json"
    if not file.is_file():
        return None
    try:
        hf = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError([f"{file}: cannot read the model config ({e}); fix or replace the file"]) from None
    hf = hf.get("text_config", hf)  # multimodal configs keep the language model's numbers under text_config
    heads = hf.get("num_attention_heads")
    experts = next((hf[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if hf.get(k)), 0)
    return ModelDims(num_attention_heads=heads, num_key_value_heads=hf.get("num_key_value_heads") or heads,
                     num_layers=hf.get("num_hidden_layers"), num_experts=experts)


def _check_model_path(key: str, path: Optional[str], errors: list[str], check_files: bool) -> None:
    if not path:
        errors.append(f"{key}: is not set; set {key}=DIR, a Hugging Face model directory (config.json + weights)")
    elif check_files:
        _need(errors, (Path(os.path.expanduser(path)) / "config.json").is_file(), key,
              f"'{path}' has no config.json", "point it at a local Hugging Face model directory")


def _check_api_key_file(path: Optional[str], errors: list[str]) -> None:
    if path:
        from megappo.rollout.sglang_server import read_api_key_file

        try:
            read_api_key_file(path)
        except ValueError as e:
            errors.append(f"actor_rollout_ref.rollout.api_key_file: {e}")


def _check_parallel_and_batches(cfg: MegappoConfig, world: int, errors: list[str], check_files: bool) -> None:
    arr, critic, data = cfg.actor_rollout_ref, cfg.critic, cfg.data
    synthetic = uses_synthetic_task(cfg)  # the trainer writes the model: no path to check, no config.json to read
    if synthetic:
        actor_dims = ModelDims()
    else:
        _check_model_path("actor_rollout_ref.model.path", arr.model.path, errors, check_files)
        actor_dims = read_model_dims(arr.model.path) or ModelDims()
    # the reference and the critic run in the actor's layout (config validation enforces it): the layout is
    # checked once against the actor's model, and again against the critic's when it is another model
    roles = [("actor_rollout_ref.actor", arr.actor.megatron, actor_dims)]
    critic_is_other_model = critic.enable and critic.model.path not in (None, arr.model.path)
    if critic_is_other_model:
        _check_model_path("critic.model.path", critic.model.path, errors, check_files)
        roles.append(("critic", critic.megatron, read_model_dims(critic.model.path) or ModelDims()))
    dp: dict[str, Optional[int]] = {}
    for role, meg, dims in roles:
        layout = ParallelLayout.from_megatron_config(meg)
        try:
            check_layout(layout, world, num_attention_heads=dims.num_attention_heads,
                         num_key_value_heads=dims.num_key_value_heads, num_layers=dims.num_layers,
                         num_experts=dims.num_experts, prefix=f"{role}.megatron")
            dp[role] = layout.dp(world)
        except LayoutError as e:
            errors.append(str(e) if f"{role}.megatron" in str(e) else f"{role}.megatron: {e}")
            dp[role] = None
        _need(errors, meg.expert_tensor_parallel_size is None or meg.expert_tensor_parallel_size >= 1,
              f"{role}.megatron.expert_tensor_parallel_size", "must be >= 1 or null", "use null to follow tp")

    rtp, rp = arr.rollout.tensor_model_parallel_size, "actor_rollout_ref.rollout.tensor_model_parallel_size"
    if rtp >= 1:
        _need(errors, world % rtp == 0, rp, f"{rtp} does not divide the world size {world}",
              "use a divisor of trainer.nnodes * trainer.n_gpus_per_node")
        heads = [(name, getattr(actor_dims, name)) for name in ("num_attention_heads", "num_key_value_heads")]
        bad = [(name, count) for name, count in heads if count is not None and count % rtp]
        if bad:  # one message: the kv-head count is the tighter bound and the fix covers both
            divisors = [d for d in range(1, bad[-1][1] + 1) if all(c % d == 0 for _, c in heads if c)]
            errors.append(f"{rp}: {rtp} does not divide the model's "
                          f"{' and '.join(f'{n}={c}' for n, c in bad)}; use one of {', '.join(map(str, divisors))}")

    n = arr.rollout.n
    _check_batches("actor_rollout_ref.actor", arr.actor.ppo_mini_batch_size, arr.actor.ppo_micro_batch_size_per_gpu,
                   arr.actor.use_dynamic_bsz, dp["actor_rollout_ref.actor"], data.train_batch_size, n, errors)
    if critic.enable and critic.ppo_mini_batch_size is not None:
        _check_batches("critic", critic.ppo_mini_batch_size, critic.ppo_micro_batch_size_per_gpu,
                       bool(critic.use_dynamic_bsz), dp.get("critic", dp["actor_rollout_ref.actor"]),
                       data.train_batch_size, n, errors)


def _check_batches(role: str, mini: int, micro: Optional[int], dynamic: bool, dp: Optional[int], train: int,
                   n: int, errors: list[str]) -> None:
    """verl's units: mini-batches count prompts (each brings rollout.n samples); micro-batches count samples."""
    key = f"{role}.ppo_mini_batch_size"
    if mini < 1:
        errors.append(f"{key}: must be >= 1, got {mini}; use a divisor of data.train_batch_size={train}")
        return
    if train % mini:
        divisors = [d for d in range(1, train + 1) if train % d == 0][-6:]
        errors.append(
            f"{key}: data.train_batch_size * rollout.n = {train}*{n} samples do not split into mini-batches of "
            f"{key} * rollout.n = {mini}*{n}; use a divisor of data.train_batch_size={train} "
            f"(e.g. {', '.join(map(str, divisors))})"
        )
        return
    if dp is None:
        return
    if (mini * n) % dp:
        errors.append(f"{key}: a mini-batch of {mini}*{n} (rollout.n) = {mini * n} samples does not split over "
                      f"{dp} data-parallel ranks; make {key} * rollout.n a multiple of {dp}")
        return
    local = mini * n // dp
    if micro and not dynamic and local % micro:
        errors.append(f"{role}.ppo_micro_batch_size_per_gpu: {micro} does not divide the per-rank mini-batch of "
                      f"{local} samples ({key} * rollout.n / dp = {mini}*{n}/{dp}); use a divisor of {local}")


def _check_synthetic_task(name: str, errors: list[str]) -> None:
    from megappo.tasks import TASKS

    _need(errors, name in TASKS, "data.synthetic.name", f"'{name}' is not a built-in task",
          f"use one of {', '.join(sorted(TASKS))}, or null to read data.train_files")


# ------------------------------------------------------------------------------------------------------------------
# files: the Parquet schema and the custom reward function
# ------------------------------------------------------------------------------------------------------------------
def _check_parquet_schemas(cfg: MegappoConfig, errors: list[str]) -> None:
    """Read the schema (not the rows) of every data file that exists; missing files are validate's message."""
    from megappo.data.errors import DataError
    from megappo.data.schema import _check_schema, expand_files, open_parquet

    for key in ("train_files", "val_files"):
        files = getattr(cfg.data, key)
        for entry in [files] if isinstance(files, str) else list(files or []):
            if not entry or not Path(os.path.expanduser(entry)).exists():
                continue
            try:
                for path in expand_files(entry):
                    pf = open_parquet(path)
                    _check_schema(path, pf.schema_arrow, cfg.data.prompt_key)
                    if pf.metadata.num_rows == 0:
                        raise DataError(path, "the file has no rows", f"regenerate it or drop it from data.{key}")
            except DataError as e:
                errors.append(f"data.{key}: {e}")


def _check_custom_reward_function(cfg: MegappoConfig, errors: list[str]) -> None:
    """Import the user's reward file and find the function in it, as the reward workers will."""
    crf = cfg.custom_reward_function
    if not crf.path or not crf.name.isidentifier() or not Path(os.path.expanduser(crf.path)).is_file():
        return  # no custom function, or validate already named the problem
    from megappo.rewards.registry import RewardFunctionError, load_custom_reward_fn

    try:
        load_custom_reward_fn(crf.path, crf.name)
    except RewardFunctionError as e:
        key = "name" if "custom_reward_function.name" in str(e) else "path"  # found the file, not the function
        errors.append(f"custom_reward_function.{key}: {e}")
