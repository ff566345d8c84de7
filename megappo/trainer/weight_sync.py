"""How the actor's weights reach the rollout engine: one strategy per way, chosen once at setup (`choose`).

Every strategy exports with the conversion code (collective over every rank) and hands the result to the engine this
rank is the sync target of (None: it only helps export), paused around the load and checked for the new version
after. `send(...)` returns the bytes it sent; `releases_engine` says whether the engine may free its weights between
a rollout and the sync (rollout.free_cache_engine): only when the sync gives it every weight back.

- `FullTensors`: every weight, in buckets (`rollout.weight_sync`: distributed, tensor).
- `AdaptedLayers`: a LoRA actor's adapted layers, merged (W + scaling * B A); the engine keeps the rest of the base.
- `LanguageModelOnly`: a vision-language actor with a frozen vision tower; the engine keeps the tower it loaded.
- `Disk`: a complete Hugging Face directory in `rollout.weight_sync_dir` that the engine reloads.
- `AdapterDirectory`: a LoRA actor's adapters as a PEFT directory the servers serve (`rollout.lora_sync=adapter`).
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

import torch.distributed as dist

from megappo.kinds.weights import iter_hf_weights
from megappo.models.lora.adapter import ADAPTED_LAYERS, ADAPTER_DIR, FullParameters
from megappo.rollout import registry
from megappo.rollout.base import Bucket, RolloutEngine
from megappo.trainer.preflight_kind import run_kind


@dataclass(frozen=True)
class SyncSetup:
    """What decides the strategy, and what every strategy needs; fixed for the run."""

    mode: str  # rollout.weight_sync, "auto" resolved to the engine's first transport
    payload: str  # what the actor's adapter sends (FULL, ADAPTED_LAYERS, ADAPTER_DIR)
    language_model_only: bool  # a vision-language actor whose tower stays as loaded (actor.freeze_vision_tower)
    weight_sync_dir: Optional[str]  # rollout.weight_sync_dir
    local_dir: Optional[str]  # trainer.default_local_dir
    base_path: str  # model.path: the tokenizer files beside a written directory, the base a PEFT directory names
    bucket_bytes: int
    dtype: Any
    ps: Any
    actor_adapter: FullParameters

    @property
    def directory(self) -> str:
        """Where the disk and adapter strategies write: rollout.weight_sync_dir, or <default_local_dir>/weight_sync."""
        return os.path.abspath(os.path.expanduser(self.weight_sync_dir or os.path.join(self.local_dir, "weight_sync")))


def around_sync(engine: RolloutEngine, version: int, send: Callable[[], Any]) -> None:
    engine.pause()
    try:
        send()
    finally:
        engine.resume()
    engine.check_version(version)


class _Counted:
    """The buckets, counting their bytes as they pass."""

    def __init__(self, buckets: Iterable[Bucket]):
        self.buckets, self.nbytes = buckets, 0

    def __iter__(self) -> Iterator[Bucket]:
        for bucket in self.buckets:
            self.nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
            yield bucket


class WeightSync:
    releases_engine = False

    def __init__(self, setup: SyncSetup):
        self.setup = setup

    @staticmethod
    def applies(setup: SyncSetup) -> bool:
        raise NotImplementedError

    def send(self, chunks: list, hf_config: dict, version: int, target: Optional[RolloutEngine]) -> int:
        """Give `target` the actor's current weights as `version`; collective over every rank. Returns the bytes."""
        raise NotImplementedError


class FullTensors(WeightSync):
    releases_engine = True
    load_kwargs: dict = {}  # what the engine's load_weights is told ({"partial": True}: the rest stays as loaded)
    export_kwargs: dict = {}  # which of the actor's weights the export gives

    @staticmethod
    def applies(setup: SyncSetup) -> bool:
        return True

    def buckets(self, chunks: list, hf_config: dict, copy: bool) -> Iterable[Bucket]:
        s = self.setup
        return iter_hf_weights(chunks, s.ps, hf_config, bucket_bytes=s.bucket_bytes, dtype=s.dtype, copy=copy,
                               **self.export_kwargs)

    def send(self, chunks: list, hf_config: dict, version: int, target: Optional[RolloutEngine]) -> int:
        mode = self.setup.mode
        # views of the parameters (no export copy) for engines that copy each bucket away at once; an engine that
        # keeps the tensors (CUDA IPC hands over their memory) gets copies
        buckets = _Counted(self.buckets(chunks, hf_config, copy=target is not None and target.needs_copies(mode)))
        if target is not None:
            around_sync(target, version, lambda: target.load_weights(buckets, version=version, mode=mode,
                                                                     **self.load_kwargs))
        else:
            for _ in buckets:  # every rank takes part in the gathers that build each bucket
                pass
        return buckets.nbytes


class AdaptedLayers(FullTensors):
    releases_engine = False
    load_kwargs = {"partial": True}
    export_kwargs = {"only_adapted": True}

    @staticmethod
    def applies(setup: SyncSetup) -> bool:
        return setup.payload == ADAPTED_LAYERS


class LanguageModelOnly(FullTensors):
    releases_engine = False
    load_kwargs = {"partial": True}
    export_kwargs = {"language_model_only": True}

    @staticmethod
    def applies(setup: SyncSetup) -> bool:
        return setup.language_model_only


class Disk(WeightSync):
    releases_engine = True

    @staticmethod
    def applies(setup: SyncSetup) -> bool:
        return setup.mode == "disk"

    def send(self, chunks: list, hf_config: dict, version: int, target: Optional[RolloutEngine]) -> int:
        from megappo.trainer.checkpointing import write_actor_hf_dir

        s = self.setup
        buckets = _Counted(iter_hf_weights(chunks, s.ps, hf_config, bucket_bytes=s.bucket_bytes, dtype=s.dtype))
        # every rank takes part in the export, rank 0 writes
        directory = write_actor_hf_dir(buckets, hf_config, s.base_path, s.directory, s.dtype)
        if target is not None:
            around_sync(target, version, lambda: target.update_weights_from_disk(directory, version=version))
        return buckets.nbytes


class AdapterDirectory(WeightSync):
    """`weight_sync_dir/lora_v<version>`, which the servers load in place of the previous one (then deleted)."""

    def __init__(self, setup: SyncSetup):
        super().__init__(setup)
        self.previous: Optional[str] = None

    @staticmethod
    def applies(setup: SyncSetup) -> bool:
        return setup.payload == ADAPTER_DIR

    def send(self, chunks: list, hf_config: dict, version: int, target: Optional[RolloutEngine]) -> int:
        from megappo.convert.peft_io import write_sync_adapter

        s = self.setup
        directory, nbytes = write_sync_adapter(chunks, s.ps, hf_config, os.path.join(s.directory, f"lora_v{version}"),
                                               s.actor_adapter.shape, s.base_path, s.dtype)
        if target is not None:
            around_sync(target, version, lambda: target.load_lora_adapter(directory, version=version))
        previous, self.previous = self.previous, directory
        if dist.get_rank() == 0 and previous not in (None, directory):  # unloaded by the servers: not needed
            shutil.rmtree(previous, ignore_errors=True)
        return nbytes


# the first that applies is the run's
STRATEGIES = (AdapterDirectory, Disk, LanguageModelOnly, AdaptedLayers, FullTensors)


def choose(cfg: Any, ps: Any, dtype: Any, actor_adapter: FullParameters) -> WeightSync:
    """The run's weight-sync strategy (`cfg`: the run's config; `actor_adapter`: the actor role's adapter object)."""
    arr = cfg.actor_rollout_ref
    rollout = arr.rollout
    mode = rollout.weight_sync if rollout.weight_sync != "auto" else registry.sync_modes(rollout.name, rollout.mode)[0]
    setup = SyncSetup(mode=mode, payload=actor_adapter.sync_payload(rollout.lora_sync),
                      language_model_only=run_kind(cfg).multi_modal and arr.actor.freeze_vision_tower,
                      weight_sync_dir=rollout.weight_sync_dir, local_dir=cfg.trainer.default_local_dir,
                      base_path=arr.model.path, bucket_bytes=rollout.weight_sync_bucket_mb << 20,
                      dtype=dtype, ps=ps, actor_adapter=actor_adapter)
    return next(strategy for strategy in STRATEGIES if strategy.applies(setup))(setup)

