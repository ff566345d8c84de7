"""The one table of the configuration's rule sets, and `validate`, which runs it.

Each capability states its rules once, beside its code (`checks.py` in algos, models.layout, models.lora, rollout,
distill; the tree's own ranges in `megappo.config.validate`), and its refusal at run time asks the same function.
A rule set is `rules(cfg, check_files) -> list[str]`, each message naming the key, what is wrong and the fix. This
module stands above every capability it asks (`megappo.testing.structure.PACKAGE_ORDER`); `megappo.trainer.preflight`
runs the table first, then the checks that need the files and the world (layouts, batches, config.json, Parquet).

    from megappo.checks import validate
    validate(load_config("gsm8k/tiny_cpu"))
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from megappo.config.fields import ConfigError
from megappo.config.schema import MegappoConfig
from megappo.config.validate import config_errors, plan, type_errors
from megappo.config.validate_episodes import episode_errors
from megappo.config.validate_judge import judge_errors
from megappo.config.validate_replay import replay_errors
from megappo.distill.checks import distillation_errors
from megappo.models.layout.checks import layout_errors
from megappo.models.lora.checks import lora_errors
from megappo.rollout.checks import engine_errors
from megappo.rollout.registry import lora_adapter_refusal


def _algorithm(cfg: Any, check_files: bool) -> list[str]:
    from megappo.algos.checks import algorithm_errors  # megappo.algos loads torch: only when a config is checked

    return algorithm_errors(cfg, check_files)


def _lora(cfg: Any, check_files: bool) -> list[str]:
    # LoRA stands below the engines: the registry answers whether this one serves adapters on this device
    refusal = lora_adapter_refusal(cfg.actor_rollout_ref.rollout.name, cfg.trainer.device)
    return lora_errors(cfg, check_files, refusal)


RuleSet = Callable[[Any, bool], list[str]]
RULE_SETS: tuple[tuple[str, RuleSet], ...] = (
    ("config", config_errors),  # the tree's own ranges and cross-field rules
    ("algorithm", _algorithm),
    ("layout", layout_errors),
    ("judge", judge_errors),
    ("episodes", episode_errors),
    ("router replay", replay_errors),
    ("rollout engine", engine_errors),
    ("lora", _lora),
    ("distillation", distillation_errors),
)


def rule_errors(cfg: MegappoConfig, world_size: Optional[int] = None, *,
                check_files: Optional[bool] = None) -> list[str]:
    """Every violation of the rule sets in `cfg`, as messages (empty when there is none); world_size and
    check_files as `validate`. Wrong types raise ConfigError at once: the rules assume well-typed values."""
    cfg, world_size, check_files = plan(cfg, world_size, check_files)
    errors = type_errors(cfg)
    if errors:
        raise ConfigError(errors)
    for _, rules in RULE_SETS:
        errors += rules(cfg, check_files)
    if world_size < 1:
        errors.append(f"world size {world_size}: needs at least one rank; set trainer.nnodes and "
                      "trainer.n_gpus_per_node to >= 1")
    return errors


def validate(cfg: MegappoConfig, world_size: Optional[int] = None, *, check_files: Optional[bool] = None) -> None:
    """Raise ConfigError listing every violation of the rule sets in `cfg`.

    world_size: ranks the run will have; None means `trainer.nnodes * trainer.n_gpus_per_node` (a real launch).
    check_files: whether data, reward and checkpoint paths must exist; by default only for a real launch
    (world_size None), so a recipe can be checked on a machine that has none of its files.
    Parallel layouts, batch divisibility and the model's config.json are checked by `megappo.trainer.preflight`.
    """
    errors = rule_errors(cfg, world_size, check_files=check_files)
    if errors:
        raise ConfigError(errors)
