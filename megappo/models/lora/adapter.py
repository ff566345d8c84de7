"""What a role's adapters mean to the rest of the run: one object per role, built once (`Role.adapter`).

The trainer, its checkpoints, the reference policy and the weight sync ask this object, never the config or the
model's attributes, whether a role trains adapters (as torchtitan's `ModelConverter`: convert the model, filter its
state dict, name the PEFT format). `FullParameters` is a role without adapters (every parameter its own, every
checkpoint whole); `LoRA` freezes the base and trains adapters over it; `AdaptersOff` is a LoRA actor run as the
reference policy (its base: the same chunks with every adapter off, no copy).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional, Sequence

from megappo.models.checkpoint_errors import CheckpointError
from megappo.models.lora.layers import LoRASettings

LORA_BASE_FILE = "lora_base.json"  # a LoRA role's checkpoint: {"path", "sha256", "lora"} of its frozen base

# what a weight sync sends the rollout engine for a role (`sync_payload`)
FULL, ADAPTED_LAYERS, ADAPTER_DIR = "full", "adapted_layers", "adapter_dir"


@dataclass(frozen=True)
class AdapterShape:
    """The adapters' shape as the config gives it: what a checkpoint's `lora_base.json` records, what
    `convert mcore-to-hf --merge-lora/--lora-only` rebuilds them with and what a PEFT `adapter_config.json` says."""

    rank: int
    alpha: float
    target_modules: list[str]
    exclude_modules: list[str]


class FullParameters:
    """A role that holds (and trains, when trainable) every parameter of its model."""

    def build_overrides(self) -> dict[str, Any]:
        """megatron TransformerConfig overrides the role's model must be built with."""
        return {}

    def convert(self, model_chunks: list, ps: Any, hf_config: dict) -> None:
        """Turn the built, loaded (unwrapped) chunks into what the role trains; before DDP and the optimizer."""

    def shared_base(self, actor_chunks: Sequence[Any]) -> Optional[list]:
        """The (unwrapped) actor chunks whose frozen base this role runs on instead of loading its own; None."""
        return None

    def reference_chunks(self, chunks: list) -> Optional[list]:
        """The chunks a reference policy runs on when it is this (actor) role's own base; None: a model of its own."""
        return None

    def active(self, chunks: list) -> ContextManager:
        """The state the role's chunks run in for one of its phases."""
        return contextlib.nullcontext()

    def checkpoint_files(self) -> dict[str, str]:
        """{file name: text} written beside the role's checkpoint."""
        return {}

    def check_checkpoint(self, role_dir: str) -> None:
        """Raise CheckpointError when `role_dir` does not hold what this role's checkpoint holds."""
        check_lora_base(role_dir, None)

    def describe(self, name: str, chunks: list, summary: Callable[[], list[str]]) -> list[str]:
        """The role's lines of the run's model summary (`summary()`: its model's)."""
        return summary()

    def sync_payload(self, lora_sync: str) -> str:
        """What a weight sync sends the engine of this actor: FULL, ADAPTED_LAYERS (merged) or ADAPTER_DIR (PEFT)."""
        return FULL


class AdaptersOff(FullParameters):
    """A LoRA actor's chunks run as the reference policy: every adapter off, the frozen base."""

    def active(self, chunks: list) -> ContextManager:
        from megappo.models.lora.layers import adapters_disabled

        return adapters_disabled(chunks)

    def describe(self, name: str, chunks: list, summary: Callable[[], list[str]]) -> list[str]:
        return [f"{name}: the actor with its LoRA adapters off (no separate copy)"]


class LoRA(FullParameters):
    """Adapters over a frozen base (`megappo.models.lora.layers`). `load_adapter(chunks, dir, ps, hf_config)`
    sets the adapters from a PEFT directory (`model.lora.adapter_path`; the conversion code's reader)."""

    def __init__(self, settings: LoRASettings, shape: AdapterShape, base_path: str, *, trainable: Sequence[str] = (),
                 adapter_path: Optional[str] = None, share_actor_base: bool = False,
                 load_adapter: Optional[Callable[..., int]] = None):
        self.settings, self.shape, self.trainable = settings, shape, tuple(trainable)
        self.adapter_path, self.share_actor_base, self.load_adapter = adapter_path, share_actor_base, load_adapter
        self.record = {"path": os.path.abspath(base_path), "sha256": base_checksum(base_path),
                       "lora": dataclasses.asdict(shape)}

    def build_overrides(self) -> dict[str, Any]:
        return {"use_transformer_engine": False}  # adapters hook megatron's own linear layers

    def convert(self, model_chunks: list, ps: Any, hf_config: dict) -> None:
        from megappo.models.lora.layers import apply_lora

        apply_lora(model_chunks, self.settings, trainable=self.trainable)
        if self.adapter_path:
            self.load_adapter(model_chunks, os.path.expanduser(self.adapter_path), ps, hf_config)

    def shared_base(self, actor_chunks: Sequence[Any]) -> Optional[list]:
        # the unwrapped chunks: DDP's wrapper adds no parameters of its own
        from megappo.models.builder import unwrap

        return [unwrap(c) for c in actor_chunks] if self.share_actor_base else None

    def reference_chunks(self, chunks: list) -> Optional[list]:
        return chunks

    def checkpoint_files(self) -> dict[str, str]:
        return {LORA_BASE_FILE: json.dumps(self.record, indent=1)}  # adapters only: name the base they belong to

    def check_checkpoint(self, role_dir: str) -> None:
        check_lora_base(role_dir, self.record)

    def describe(self, name: str, chunks: list, summary: Callable[[], list[str]]) -> list[str]:
        from megappo.models.lora.layers import trainable_summary

        trained, total = trainable_summary(chunks)
        return summary() + [f"{name} LoRA: {trained:,} of {total:,} parameters trainable on this rank "
                            f"({100 * trained / max(total, 1):.2f}%)"]

    def sync_payload(self, lora_sync: str) -> str:
        # merged: the engines keep the rest of the base they loaded; adapter: SGLang serves the PEFT directory
        return ADAPTER_DIR if lora_sync == "adapter" else ADAPTED_LAYERS


def for_role(name: str, lora: LoRASettings, base_path: str, *, adapter_path: Optional[str] = None,
             share_actor_base: bool = False, load_adapter: Optional[Callable[..., int]] = None) -> FullParameters:
    """The adapter object of a trainable role (`name`: actor | critic) with the adapters `lora` (its `model.lora`
    section, as `megappo.trainer.settings.lora_settings` maps it; `adapter_path`, `share_actor_base`: its keys)."""
    if name not in ("actor", "critic") or lora.rank <= 0:
        return FullParameters()
    shape = AdapterShape(lora.rank, lora.alpha, list(lora.target_modules), list(lora.exclude_modules))
    # a critic trains its fresh value head along with the adapters
    return LoRA(lora, shape, base_path, trainable=("output_layer",) if name == "critic" else (),
                adapter_path=adapter_path, share_actor_base=share_actor_base, load_adapter=load_adapter)


def base_checksum(path: str) -> str:
    """sha256 over the base model directory's config.json and weight files (names, sizes and bytes)."""
    h = hashlib.sha256()
    names = sorted(n for n in os.listdir(path) if n == "config.json" or n.endswith((".safetensors", ".bin")))
    for n in names:
        full = os.path.join(path, n)
        h.update(f"{n}\0{os.path.getsize(full)}\0".encode())
        with open(full, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
    return h.hexdigest()


def read_lora_base(role_dir: str) -> Optional[dict]:
    """The base record a LoRA role's checkpoint holds; None for a full model's."""
    path = os.path.join(role_dir, LORA_BASE_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def check_lora_base(role_dir: str, lora_base: Optional[dict]) -> None:
    """Refuse a LoRA checkpoint whose adapters belong to another base model than this run's (by checksum), and a
    LoRA checkpoint for a full model or the other way round (`lora_base`: this run's record, None for a full model)."""
    saved = read_lora_base(role_dir)
    if saved is None and lora_base is None:
        return
    if saved is None or lora_base is None:
        what = "LoRA adapters" if saved is not None else "full weights (no LoRA)"
        raise CheckpointError(f"{role_dir} holds {what}, this run's {os.path.basename(role_dir)} "
                              f"{'is a full model' if lora_base is None else 'trains LoRA adapters'}: set model.lora "
                              "as the run that saved it did")
    if saved.get("sha256") != lora_base["sha256"]:
        raise CheckpointError(
            f"{role_dir} holds LoRA adapters of the base model {saved.get('path')} (sha256 "
            f"{str(saved.get('sha256'))[:12]}...), this run's base {lora_base['path']} differs (sha256 "
            f"{lora_base['sha256'][:12]}...): resume with the base model the adapters were trained on")


def served_adapter(lora: Any, lora_sync: str, serving: Callable[[int, tuple[str, ...]], Any]) -> Optional[Any]:
    """What the rollout servers serve of the actor's `model.lora` config (`rollout.lora_sync=adapter`: its rank and
    target layers, as `serving` makes them); None when they serve merged weights. The caller passes
    `megappo.rollout.settings.AdapterServing`: the models stand below the rollout engines."""
    return serving(lora.rank, tuple(lora.target_modules)) if lora_sync == "adapter" else None
