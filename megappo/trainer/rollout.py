"""The rollout side of the trainer: generation over data-parallel ranks, and weight sync, for any engine.

The engine comes from the registry by `rollout.name` (`megappo.rollout.registry`), deployed over the ranks as it
needs (`RolloutDeployment`): the in-process engine is one model per data-parallel replica, SGLang a set of servers
every replica shares. Each replica's first rank (the holder) generates for its replica's share of the prompts; the
completions go to the replica's other ranks and then to every rank (`Samples`, token lists: small), so every rank
sees the whole step.

Weight sync is the run's strategy (`megappo.trainer.weight_sync`, chosen once): it exports the actor with the
conversion code (collective over every rank) into the engine each rank is the sync target of (a holder's own
engine; the servers' from global rank 0), paused around it and checked for the new version after.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from megappo.config.schema import MegappoConfig
from megappo.data.dataset import PromptBatch
from megappo.models.lora.adapter import FullParameters
from megappo.parallel import ParallelState
from megappo.platform.device import Platform
from megappo.rollout import registry
from megappo.rollout.base import RolloutDeployment, RolloutEngine
from megappo.rollout.sampling import Completion, SamplingParams
from megappo.trainer import weight_sync
from megappo.trainer.experience import Samples
from megappo.trainer.settings import episodes, rollout_settings


def _broadcast_objects(objs: list, group: Any, src_group_rank: int = 0) -> list:
    if dist.get_world_size(group) > 1:
        dist.broadcast_object_list(objs, src=dist.get_global_rank(group, src_group_rank), group=group)
    return objs


def _dp_slice(n: int, ps: ParallelState) -> slice:
    """This data-parallel rank's prompts: contiguous, the last ranks get fewer when `n` does not divide."""
    per = -(-n // ps.dp_size)
    return slice(min(n, ps.dp_rank * per), min(n, (ps.dp_rank + 1) * per))


class RolloutWorker:
    """Generates a step's responses and takes the actor's weights after each update."""

    def __init__(self, cfg: MegappoConfig, ps: ParallelState, platform: Platform,
                 actor_adapter: Optional[FullParameters] = None):
        """`actor_adapter`: the actor role's adapter object (`Role.adapter`; default: a full-parameter actor)."""
        self.cfg, self.ps, self.platform = cfg, ps, platform
        self.rollout = cfg.actor_rollout_ref.rollout
        self.deployment: RolloutDeployment = registry.deploy(rollout_settings(cfg), ps, platform)
        # the episode loop's engine wrapper (holders only), when samples are episodes (tools, environments, agents)
        self.episodes: Optional[RolloutEngine] = None
        settings = episodes(cfg)
        if settings is not None and self.deployment.engine is not None:
            from megappo.envs.engine import build_episodes
            from megappo.trainer.agent_loops import loop_kinds

            # the holder runs its share's episodes; weights still go to the engine itself
            self.episodes = build_episodes(settings, self.deployment.engine, loop_kinds())
        self.weights = weight_sync.choose(cfg, ps, platform.dtype, actor_adapter or FullParameters())
        self.engine_released = False  # release_engine() freed this rank's engine's weights since the last sync

    @property
    def engine(self) -> RolloutEngine | None:
        """This rank's engine (holders only)."""
        return self.episodes or self.deployment.engine

    # -- generation ------------------------------------------------------------------------------------------------
    def generate(self, prompts: PromptBatch, params: SamplingParams, prompt_offset: int = 0) -> Samples:
        """The responses to every prompt of `prompts` (the global batch), identical on every rank; collective.

        Each sample is drawn with its own seed, from `params.seed`, its prompt's index (`prompt_offset` + its index
        in `prompts`: validation's later batches continue the count) and its sample index (`megappo.rollout.seeds`),
        whichever data-parallel rank generates it: the samples, and so the step, are those of one rank generating
        the whole batch."""
        local = None
        share = self.share(prompts)
        if share is not None:
            ids, offset = share
            local = self.engine.generate(ids, params, prompt_offset=prompt_offset + offset,
                                         **self.share_request(prompts)) if ids else []
        return self._gather(prompts, local)

    def collect(self, prompts: PromptBatch, pending: Optional[Future]) -> Samples:
        """The samples of a batch whose holder shares (`share`) are generated in the background (`pending`: the
        holder's future, None elsewhere), identical on every rank; collective (the holders wait for their engine)."""
        return self._gather(prompts, pending.result() if pending is not None else None)

    def share(self, prompts: PromptBatch) -> Optional[tuple[list[list[int]], int]]:
        """The holder's prompts (token ids, unpadded) and the index of the first in the batch; None elsewhere."""
        if self.engine is None:
            return None
        part = _dp_slice(len(prompts), self.ps)
        ids = [prompts.input_ids[b][prompts.attention_mask[b].bool()].tolist() for b in range(part.start, part.stop)]
        return ids, part.start

    def share_images(self, prompts: PromptBatch) -> Optional[list]:
        """The holder's prompts' images (`PromptBatch.multi_modal`, aligned with `share`'s ids); None for text."""
        images = getattr(prompts, "multi_modal", None)
        if self.engine is None or not images or all(m is None for m in images):
            return None
        return list(images[_dp_slice(len(prompts), self.ps)])

    def share_request(self, prompts: PromptBatch) -> dict:
        """The holder's request keywords beside its prompts: the images of vision-language prompts, and the
        dataset rows of episodes (an engine is asked only about what it takes)."""
        request = image_kwargs(self.share_images(prompts))
        if self.episodes is not None:
            request["rows"] = episode_rows(prompts, _dp_slice(len(prompts), self.ps))
        return request

    def _gather(self, prompts: PromptBatch, local: Optional[list[list[Completion]]]) -> Samples:
        completions: list[list[Completion]] = _broadcast_objects([local], self.ps.mp_group)[0]
        if self.ps.dp_size > 1:
            gathered: list = [None] * self.ps.dp_size
            dist.all_gather_object(gathered, completions, group=self.ps.dp_group)
            completions = [group for part_groups in gathered for group in part_groups]
        return Samples.from_completions(prompts, completions)

    # -- weights ---------------------------------------------------------------------------------------------------
    def sync_weights(self, actor_chunks: Sequence[torch.nn.Module], hf_config: dict, version: int) -> dict[str, float]:
        """Load the actor's current weights into the engine(s) as `version` (`self.weights`, the run's strategy);
        collective over every rank. Engines are paused around it and must report the version afterwards."""
        t0 = time.perf_counter()
        health = self.deployment.prepare_sync()
        nbytes = self.weights.send(list(actor_chunks), hf_config, version, self.deployment.sync_target)
        self._set_version(version)
        self.engine_released = False
        seconds = time.perf_counter() - t0
        return {"rollout/weight_version": float(version), "rollout/weight_sync_bytes": float(nbytes),
                "perf/weight_sync_gbps": nbytes / 1e9 / max(seconds, 1e-9), **health}

    def _set_version(self, version: int) -> None:
        """Every holder's engine stamps its completions with `version` (a shared server's clients that did not send
        the weights learn it here)."""
        if self.engine is not None:
            self.engine.weight_version = version

    def release_engine(self) -> bool:
        """rollout.free_cache_engine: free the weights of the engine this rank syncs (the in-process hybrid engine;
        a server's memory is not this process's) until the step's weight sync refills them; returns whether this
        rank freed any. Only for a strategy that sends the engine every weight (`WeightSync.releases_engine`: not a
        LoRA actor's adapted layers, nor a frozen-tower vision-language actor's language model, which leave the
        engine the rest). Call it once the step is done with the engine (after its rollout) and only in a step that
        syncs."""
        target = self.deployment.sync_target
        if not self.rollout.free_cache_engine or target is None or not self.weights.releases_engine:
            return False
        self.engine_released = target.release_weights()
        return self.engine_released

    def skip_sync(self, version: int) -> dict[str, float]:
        """The sync of a run that saves and stops now: the weights get their version number (the checkpoint records
        it, so a resumed run's versions are the uninterrupted run's) but go nowhere, and dead servers are not healed:
        the servers are stopped after the save, and the grace time before Slurm's SIGKILL is the save's. The resumed
        run loads the saved weights into its engines before its first rollout. The engine's health is reported as it
        stands."""
        self._set_version(version)
        return {"rollout/weight_version": float(version), "rollout/weight_sync_bytes": 0.0,
                "rollout/weight_sync_skipped": 1.0, **self.deployment.health()}

    def engine_log_probs(self, token_ids: Sequence[int]) -> list[list[float]]:
        """Global rank 0: each engine's log p(token_ids[k] | token_ids[:k]) for k >= 1 (rollout.verify_sync)."""
        return self.deployment.sync_target.prompt_log_probs(token_ids)

    def close(self) -> None:
        if self.episodes is not None:  # the wrapper's loop, then the engine
            self.episodes.close()
        self.deployment.close()


def episode_rows(prompts: PromptBatch, part: slice) -> list:
    """The dataset rows of `prompts[part]`, as the environments read them."""
    from megappo.envs.base import EpisodeRow

    return [EpisodeRow(prompt=prompts.raw_prompts[b], data_source=prompts.data_sources[b],
                       ground_truth=prompts.ground_truths[b], extra_info=dict(prompts.extra_infos[b] or {}),
                       index=int(prompts.indices[b]), agent_name=prompts.agent_names[b])
            for b in range(part.start, part.stop)]


def image_kwargs(images: Optional[list]) -> dict:
    """The engines' `generate(..., multi_modal=...)` keyword for prompts with images; nothing for text prompts (text
    runs call the engines exactly as before)."""
    return {"multi_modal": images} if images else {}


def step_seed(base: int, step: int) -> int:
    """The sampling seed of a step: a resumed run samples exactly what the uninterrupted one did."""
    return (base * 1_000_003 + step * 7_919) % (2**31 - 1)
