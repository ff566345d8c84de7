"""The run's model kind (`megappo.kinds`) and its preflight rules.

Light to import (no torch): the model type comes from `<model.path>/config.json` when it is there, or from the
synthetic task whose model the run writes (`model_type` of the task, e.g. `megappo.tasks.colour_square`).
"""
from __future__ import annotations

from typing import Optional

from megappo.config import MegappoConfig
from megappo.kinds import ModelKind, kind_of


def _task_model_type(name: Optional[str]) -> Optional[str]:
    """The model type of the model a synthetic task writes (None: no task, or a task that does not say)."""
    if not name:
        return None
    from megappo.tasks import TASKS

    return getattr(TASKS.get(name), "model_type", None)  # an unknown task is preflight's own error


def run_kind(cfg: MegappoConfig) -> ModelKind:
    """The kind of the run's actor."""
    model_type = _task_model_type(cfg.data.synthetic.name)
    return kind_of({"model_type": model_type} if model_type else cfg.actor_rollout_ref.model.path)


def _engine_takes_images(cfg: MegappoConfig) -> bool:
    """Whether the run's rollout engine feeds the prompts' images (an unknown engine is preflight's own error, not
    refused here)."""
    from megappo.rollout.registry import multi_modal, unknown_engine

    name = cfg.actor_rollout_ref.rollout.name
    return bool(unknown_engine(name)) or multi_modal(name)


def check_model_kind(cfg: MegappoConfig, errors: list[str]) -> None:
    """Append the errors of the run's model kind's preflight rules (what it does not support yet)."""
    errors += run_kind(cfg).preflight(cfg, _engine_takes_images(cfg))
