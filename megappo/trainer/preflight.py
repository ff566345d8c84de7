"""Everything `megappo train` checks before any rank starts work, every problem collected into one ConfigError.

`preflight(cfg)` runs the configuration's rule sets (`megappo.checks`) and then the checks that need the
rest of megappo: each role's parallel layout against the world size and the model's head, layer and expert counts
(read from `<model.path>/config.json` when it is there), the rollout's tensor-parallel size, and how batches split
into mini- and micro-batches over data-parallel ranks, and the prompt plus response budget against the model's
max_position_embeddings. With check_files it also reads the schema of every Parquet file, imports the custom reward
function, checks that trainer.default_local_dir can be created and written, and, when the trainer starts SGLang
servers, that their python (rollout.server_python) has SGLang. With data.synthetic.name set, the trainer writes
the model and the Parquet files itself: the task must exist, and neither is read. Multi-turn tools are imported and
their schemas checked, and the chat template must show them (megappo/trainer/preflight_tools.py). Each message names
the key, what is wrong and the fix.

Light to import: no torch, megatron or pyarrow until a check needs them.
"""
from __future__ import annotations

import errno
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megappo.config import ConfigError, MegappoConfig
from megappo.checks import rule_errors
from megappo.config.validate import plan, uses_synthetic_task
from megappo.platform.layout import LayoutError, ParallelLayout, check_layout
from megappo.rollout.registry import unknown_engine
from megappo.trainer.preflight_agents import check_agents
from megappo.trainer.preflight_tools import check_multi_turn_tools
from megappo.trainer.preflight_kind import check_model_kind


@dataclass(frozen=True)
class ModelDims:
    num_attention_heads: Optional[int] = None
    num_key_value_heads: Optional[int] = None
    num_layers: Optional[int] = None
    num_experts: Optional[int] = None  # 0 when config.json was read and names no experts
    max_position_embeddings: Optional[int] = None


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
    _check_sequence_length(cfg, errors)
    _check_placement(cfg, errors, launching=check_files)
    _check_rollout_correction(cfg, errors)
    check_model_kind(cfg, errors)
    check_multi_turn_tools(cfg, errors, check_files, uses_synthetic_task(cfg))
    check_agents(cfg, errors, check_files)
    _check_router_replay(cfg, errors)
    if check_files:
        errors += _output_dir_errors(cfg)
        if not unknown_engine(cfg.actor_rollout_ref.rollout.name):  # the rule sets name an unknown one
            _check_engine(cfg, errors)
        if not uses_synthetic_task(cfg):
            _check_parquet_schemas(cfg, errors)
        _check_custom_reward_function(cfg, errors)
        if cfg.distillation.enabled:
            from megappo.distill.checks import teacher_model_problems

            meg = cfg.actor_rollout_ref.actor.megatron
            errors += teacher_model_problems(cfg, meg.tensor_model_parallel_size, meg.pipeline_model_parallel_size)
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
                     num_layers=hf.get("num_hidden_layers"), num_experts=experts,
                     max_position_embeddings=hf.get("max_position_embeddings"))


# how to make a small model to point a recipe at (recipes/gsm8k/tiny_cpu.yaml needs one)
MAKE_TINY_MODEL = "python -m megappo.testing model --family qwen2 --out DIR"


def _check_model_path(key: str, path: Optional[str], errors: list[str], check_files: bool) -> None:
    if not path:
        errors.append(f"{key}: is not set; set {key}=DIR, a Hugging Face model directory (config.json + weights)")
    elif check_files and not (Path(os.path.expanduser(path)) / "config.json").is_file():
        fix = "point it at a local Hugging Face model directory"
        if not os.path.exists(os.path.expanduser(path)):
            fix += f" (for a tiny test model to try a recipe with: `{MAKE_TINY_MODEL}`)"
        errors.append(f"{key}: '{path}' has no config.json; {fix}")


def _check_sequence_length(cfg: MegappoConfig, errors: list[str]) -> None:
    """A prompt plus its response must fit the actor's positions (max_position_embeddings): longer ones are cut
    or misread by the tokenizer and the rotary embedding, and training goes on with broken samples."""
    arr, data = cfg.actor_rollout_ref, cfg.data
    if uses_synthetic_task(cfg):
        from megappo.tasks import TASKS

        task = TASKS.get(cfg.data.synthetic.name)
        limit = task.model.get("max_position_embeddings") if task is not None else None
        where = f"the synthetic task {cfg.data.synthetic.name}'s model"
    else:
        try:
            dims = read_model_dims(arr.model.path)
        except ConfigError:
            return  # an unreadable config.json is named by the layout check
        limit = dims.max_position_embeddings if dims is not None else None
        where = f"the actor's model ({arr.model.path}/config.json)"
    override = (arr.model.override_config or {}).get("max_position_embeddings")
    if isinstance(override, int):
        limit, where = override, "actor_rollout_ref.model.override_config.max_position_embeddings"
    total = data.max_prompt_length + data.max_response_length
    if isinstance(limit, int) and limit > 0 and total > limit:
        errors.append(
            f"data.max_prompt_length + data.max_response_length: {data.max_prompt_length} + "
            f"{data.max_response_length} = {total} tokens exceed max_position_embeddings={limit} of {where}; "
            f"lower data.max_prompt_length and/or data.max_response_length to a total of at most {limit}")


def _check_router_replay(cfg: MegappoConfig, errors: list[str]) -> None:
    """Router replay needs a MoE actor: a dense one has no routes, which setup would find only after the model (and a
    synthetic task's warm start) is built. The model is the synthetic task's, else `<model.path>/config.json`'s
    when it is there to read."""
    mode = cfg.actor_rollout_ref.actor.megatron.router_replay.mode
    if mode == "disabled":
        return
    if uses_synthetic_task(cfg):
        from megappo.tasks import TASKS, digit_max_moe

        name = cfg.data.synthetic.name
        dense, which = name in TASKS and name not in digit_max_moe.TASKS, f"the synthetic task {name}'s"
        alternative = f" (or data.synthetic.name={', '.join(sorted(digit_max_moe.TASKS))}, a task on a MoE policy)"
    else:
        try:
            dims = read_model_dims(cfg.actor_rollout_ref.model.path)
        except ConfigError:
            return  # an unreadable config.json is named by the layout check
        dense, which, alternative = dims is not None and dims.num_experts == 0, "the actor's", ""
    key = "actor_rollout_ref.actor.megatron.router_replay.mode"
    _need(errors, not dense, key, f"is {mode} but {which} model is dense (no MoE experts), so it has no routes to "
          "replay", f"set {key}=disabled{alternative}")


# ------------------------------------------------------------------------------------------------------------------
# the output directory and the SGLang server's python
# ------------------------------------------------------------------------------------------------------------------
def output_dir_problem(path: str) -> Optional[str]:
    """Why the directory `path` cannot be created or written (None when it can), without creating it: the
    nearest existing ancestor takes a probe directory, created and removed at once. An existing directory is asked
    (access(2), which also knows read-only mounts) and left untouched: it may be another run's, which the directory
    lock (`megappo.trainer.run_lock`) is about to refuse."""
    target = os.path.abspath(os.path.expanduser(path))
    existing = target
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return (f"'{path}' cannot be created: '{existing}' is a file" if existing != target
                else f"'{path}' is a file, not a directory")
    if existing == target:
        if os.access(target, os.W_OK | os.X_OK):
            return None
        read_only = bool(os.statvfs(target).f_flag & os.ST_RDONLY)
        return f"'{path}' cannot be written ({'a read-only file system' if read_only else 'no permission'})"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".megappo-write-check-", dir=existing))
    except OSError as e:
        why = {errno.EACCES: "no permission", errno.EPERM: "not permitted", errno.EROFS: "a read-only file system",
               errno.ENOSPC: "no space left"}.get(e.errno, e.strerror or type(e).__name__)
        return f"'{path}' cannot be created in '{existing}' ({why})"
    return None


def _output_dir_errors(cfg: MegappoConfig) -> list[str]:
    problem = output_dir_problem(cfg.trainer.default_local_dir)
    return [f"trainer.default_local_dir: {problem}; set trainer.default_local_dir=DIR to a directory you can write "
            "(on storage every node shares, for more than one node)"] if problem else []


def require_output_dir(cfg: MegappoConfig) -> None:
    """Raise ConfigError naming trainer.default_local_dir when the run could not create or write it (for
    `megappo.trainer.build.setup`, before it writes there; `preflight` with check_files runs the same check)."""
    errors = _output_dir_errors(cfg)
    if errors:
        raise ConfigError(errors)


def _check_placement(cfg: MegappoConfig, errors: list[str], launching: bool) -> None:
    """Where the rollout runs for async_training.mode. Overlap needs the engine beside the trainer
    (actor_rollout_ref.hybrid_engine=false): the in-process engine then runs in its own process; SGLang servers are
    processes of their own, but on GPU the ones the trainer starts share the trainer's GPUs, so they must be given by
    rollout.server_urls (started on their own GPUs or nodes: launch/slurm/train_sglang.sbatch, which fills them in
    at launch, so a recipe is only checked for them when it is launched: `launching`)."""
    arr, mode = cfg.actor_rollout_ref, cfg.async_training.mode
    r = arr.rollout
    if mode != "sync" and arr.hybrid_engine:
        errors.append(f"async_training.mode={mode} generates while the trainer trains, so the rollout engine must "
                      "run beside it, not inside it: set actor_rollout_ref.hybrid_engine=false (the in-process "
                      "engine then runs in a process of its own; give it CPU threads with "
                      "actor_rollout_ref.rollout.engine_kwargs.threads)")
    a = cfg.async_training
    if mode == "fully_async":
        per_step = a.require_batches * arr.actor.ppo_mini_batch_size
        _need(errors, cfg.data.train_batch_size == per_step, "data.train_batch_size",
              f"is {cfg.data.train_batch_size} but a fully_async step trains async_training.require_batches="
              f"{a.require_batches} mini-batches of {arr.actor.ppo_mini_batch_size} prompts", f"set it to {per_step}")
        _need(errors, a.trigger_parameter_sync_step >= 1, "async_training.trigger_parameter_sync_step",
              f"must be >= 1, got {a.trigger_parameter_sync_step}", "sync at least every step (1)")
        _need(errors, a.staleness_threshold >= 0, "async_training.staleness_threshold",
              f"must be >= 0, got {a.staleness_threshold}", "use 0 (no stale samples) or a fraction such as 0.5")
        from megappo.rollout.registry import partial_rollout

        _need(errors, not a.partial_rollout or partial_rollout(r.name), "async_training.partial_rollout",
              f"needs an engine that returns aborted generations' tokens; {r.name} does not yet",
              "set async_training.partial_rollout=false (a sync then waits for the generation in progress)")
    from megappo.rollout.checks import served

    shares_gpus = served(r) and not r.server_urls and cfg.trainer.device == "cuda"
    if launching and not arr.hybrid_engine and shares_gpus:
        errors.append(f"actor_rollout_ref.hybrid_engine=false with {r.name} servers on GPU: the servers the trainer "
                      "starts would share its GPUs; start them on their own GPUs or nodes and name them in "
                      "actor_rollout_ref.rollout.server_urls (launch/slurm/train_sglang.sbatch does), or set "
                      "actor_rollout_ref.hybrid_engine=true with async_training.mode=sync")


def _check_rollout_correction(cfg: MegappoConfig, errors: list[str]) -> None:
    """algorithm.rollout_correction's values (thresholds parse, options exist), as the math reads them."""
    from megappo.config.schema import RolloutCorrectionConfig

    if cfg.algorithm.rollout_correction == RolloutCorrectionConfig():
        return  # the defaults (torch stays unloaded)
    from megappo.trainer.settings import rollout_correction

    try:
        rollout_correction(cfg).check()
    except ValueError as e:
        errors.append(str(e))


def _check_engine(cfg: MegappoConfig, errors: list[str]) -> None:
    """The rollout engine's own checks (`rollout.registry.preflight`: SGLang's servers need a python with SGLang
    and a readable API key file)."""
    from megappo.rollout.registry import preflight as engine_preflight

    errors += engine_preflight(cfg)


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
                    _check_schema(path, pf.schema_arrow, cfg.data.prompt_key, cfg.data.image_key)
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
