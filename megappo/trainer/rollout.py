"""The rollout side of the trainer: which ranks hold an engine, generation over data-parallel ranks, weight sync.

Each data-parallel replica of the actor (a model-parallel group) has one engine holder, its first rank. The holder
generates for its replica's share of the prompts; the completions go to the replica's other ranks and then to
every rank (`Samples`, token lists: small), so every rank sees the whole step. Engines:

- `hf`: megappo's in-process engine (`HFEngine`), one per replica, on the same HF weights as the actor.
- `sglang`: SGLang servers; each node's first rank starts its share of them (`ServerSet`, rollout_servers.py)
  unless `rollout.server_urls` names running ones. Every replica's holder spreads its requests over all of them,
  itself or through sglang-router (`SGLangFleet`: a failed server's rows go to another, every sample comes back
  once); global rank 0 streams the weights into all of them with one broadcast. Before each sync dead servers are
  restarted (or dropped), so the sync gives them the current weights.

Weight sync exports the actor with the conversion code (`iter_hf_weights`, collective over every rank) and loads
the buckets into the engine(s) on the holders.
"""
from __future__ import annotations

import os
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist

from megappo.config.schema import MegappoConfig
from megappo.convert.export import iter_hf_weights
from megappo.data.dataset import PromptBatch
from megappo.parallel import ParallelState
from megappo.platform.device import Platform
from megappo.rollout.sampling import Completion, SamplingParams
from megappo.trainer.experience import Samples


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

    def __init__(self, cfg: MegappoConfig, ps: ParallelState, platform: Platform):
        self.cfg, self.ps, self.platform = cfg, ps, platform
        self.rollout = cfg.actor_rollout_ref.rollout
        self.holder = dist.get_rank(ps.mp_group) == 0
        self.servers: Any = None  # sglang: the run's ServerSet
        self.engine: Any = None  # this replica's engine (holders only)
        self.sync_engine: Any = None  # sglang: the engine global rank 0 streams weights into
        self.bucket_bytes = self.rollout.weight_sync_bucket_mb << 20
        if self.rollout.name == "hf":
            if self.holder:
                from megappo.rollout import HFEngine

                self.engine = HFEngine(cfg.actor_rollout_ref.model.path, dtype=platform.dtype, device=platform.device,
                                       max_num_seqs=self.rollout.max_num_seqs, seed=cfg.data.seed,
                                       trust_remote_code=cfg.actor_rollout_ref.model.trust_remote_code)
        else:
            self._connect_sglang()
        self.weight_version = 0

    # -- SGLang ----------------------------------------------------------------------------------------------------
    def _connect_sglang(self) -> None:
        from megappo.rollout.sglang_fleet import SGLangFleet
        from megappo.trainer.rollout_servers import ServerSet

        r = self.rollout
        self.servers = ServerSet(self.cfg, self.platform, self._server_kwargs())
        self.servers.start()
        if self.holder:
            self.engine = SGLangFleet(
                self.servers.urls, timeout=r.request_timeout_s, tp_size=r.tensor_model_parallel_size,
                engine_kwargs={"api_key": self.servers.api_key, "sync_timeout": r.sync_timeout_s},
                master_address=r.weight_sync_master_address or r.server_host,
                backend="nccl" if self.platform.is_cuda else "gloo", router_url=self.servers.router_url,
                health_check_interval_s=r.health_check_interval_s, health_check_timeout_s=r.health_check_timeout_s)
            self.sync_engine = self.engine if dist.get_rank() == 0 else None

    def _heal_servers(self) -> dict[str, float]:
        """Collective, before a sync: dead servers restarted (or dropped) and every client told; the sync that
        follows gives a restarted server the current weights before it serves again."""
        fleet = self.engine if self.holder else None
        dropped = {fleet.urls[k] for k, ok in enumerate(fleet.alive) if not ok} if fleet is not None else set()
        if self.servers.heal(dropped) and fleet is not None:
            fleet.set_servers(self.servers.urls, self.servers.alive, self.servers.router_url)
        return {"rollout/servers_live": float(sum(self.servers.alive)),
                "rollout/server_restarts": float(self.servers.restarts)}

    def _server_kwargs(self) -> dict:
        """SGLangServer arguments: the rollout dtype, then `rollout.engine_kwargs` (dtype, max_total_tokens,
        extra_args: a list of further launch_server flags)."""
        from megappo.trainer import rollout_servers

        dtype = self.rollout.dtype or str(self.platform.dtype).replace("torch.", "")
        known = ("dtype", "max_total_tokens", "extra_args", "port", "host", "api_key")
        unknown = sorted(set(self.rollout.engine_kwargs) - set(known))
        if unknown:
            raise ValueError(f"actor_rollout_ref.rollout.engine_kwargs: {unknown} are not SGLangServer arguments; "
                             f"use {known} (pass other launch_server flags as extra_args: [--flag, value])")
        return {"dtype": dtype, "trust_remote_code": self.cfg.actor_rollout_ref.model.trust_remote_code,
                "host": self.rollout.server_host, "api_key": rollout_servers.configured_api_key(self.rollout),
                **self.rollout.engine_kwargs}

    # -- generation ------------------------------------------------------------------------------------------------
    def generate(self, prompts: PromptBatch, params: SamplingParams, prompt_offset: int = 0) -> Samples:
        """The responses to every prompt of `prompts` (the global batch), identical on every rank.

        Each sample is drawn with its own seed, from `params.seed`, its prompt's index (`prompt_offset` + its index
        in `prompts`: validation's later batches continue the count) and its sample index (`megappo.rollout.seeds`),
        whichever data-parallel rank generates it: the samples, and so the step, are those of one rank generating
        the whole batch."""
        part = _dp_slice(len(prompts), self.ps)
        local: list = [None]
        if self.holder:
            ids = [prompts.input_ids[b][prompts.attention_mask[b].bool()].tolist()
                   for b in range(part.start, part.stop)]
            local = [self.engine.generate(ids, params, prompt_offset=prompt_offset + part.start) if ids else []]
        completions: list[list[Completion]] = _broadcast_objects(local, self.ps.mp_group)[0]
        if self.ps.dp_size > 1:
            gathered: list = [None] * self.ps.dp_size
            dist.all_gather_object(gathered, completions, group=self.ps.dp_group)
            completions = [group for part_groups in gathered for group in part_groups]
        return Samples.from_completions(prompts, completions)

    # -- weights ---------------------------------------------------------------------------------------------------
    def sync_weights(self, actor_chunks: Sequence[torch.nn.Module], hf_config: dict) -> dict[str, float]:
        """Load the actor's current weights into the engine(s); collective over every rank. SGLang servers are
        paused around it (and their prefix caches flushed), and must report the new version afterwards."""
        version = self.weight_version + 1
        t0 = time.perf_counter()
        health = self._heal_servers() if self.servers is not None else {}
        mode = self.sync_mode
        # views of the parameters (no export copy) for the consumers that copy each bucket away at once: the
        # in-process engine, a broadcast, the shared-memory staging of CPU tensors. The disk writer and CUDA IPC
        # (which would hand the servers the parameters' own memory) get copies.
        cuda_ipc = mode == "tensor" and self.rollout.name != "hf" and self.platform.device.type == "cuda"
        keep = mode == "disk" or cuda_ipc
        buckets = iter_hf_weights(list(actor_chunks), self.ps, hf_config, bucket_bytes=self.bucket_bytes,
                                  dtype=self.platform.dtype, copy=keep)
        nbytes = 0

        def counted():
            nonlocal nbytes
            for bucket in buckets:
                nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
                yield bucket

        target = self.engine if self.rollout.name == "hf" else self.sync_engine
        if mode == "disk":
            directory = self._write_sync_dir(counted(), hf_config)  # every rank takes part in the export
            if target is not None:
                self._around_sync(target, version, lambda: target.update_weights_from_disk(directory, version=version))
        elif self.holder and target is not None:
            if self.rollout.name == "hf":
                target.update_weights(counted(), version=version)
            else:
                send = target.update_weights_from_tensor if mode == "tensor" else target.update_weights
                self._around_sync(target, version, lambda: send(counted(), version=version))
        else:
            for _ in counted():  # every rank takes part in the gathers that build each bucket
                pass
        if self.rollout.name != "hf" and self.holder and self.engine is not None:
            self.engine.weight_version = version
        self.weight_version = version
        seconds = time.perf_counter() - t0
        return {"rollout/weight_version": float(version), "rollout/weight_sync_bytes": float(nbytes),
                "perf/weight_sync_gbps": nbytes / 1e9 / max(seconds, 1e-9), **health}

    def skip_sync(self) -> dict[str, float]:
        """The sync of a run that saves and stops now: the weights get their version number (the checkpoint records
        it, so a resumed run's versions are the uninterrupted run's) but go nowhere, and dead servers are not healed:
        the servers are stopped after the save, and the grace time before Slurm's SIGKILL is the save's. The resumed
        run loads the saved weights into its engines before its first rollout. The servers' health is reported as
        it stands."""
        self.weight_version += 1
        if self.rollout.name != "hf" and self.holder and self.engine is not None:
            self.engine.weight_version = self.weight_version
        health = {} if self.servers is None else {"rollout/servers_live": float(sum(self.servers.alive)),
                                                  "rollout/server_restarts": float(self.servers.restarts)}
        return {"rollout/weight_version": float(self.weight_version), "rollout/weight_sync_bytes": 0.0,
                "rollout/weight_sync_skipped": 1.0, **health}

    def engine_log_probs(self, token_ids: Sequence[int]) -> list[list[float]]:
        """Global rank 0: each engine's log p(token_ids[k] | token_ids[:k]) for k >= 1 (rollout.verify_sync)."""
        if self.rollout.name != "hf":
            return self.sync_engine.prompt_log_probs(token_ids)
        model, device = self.engine.model, self.engine.device
        ids = torch.tensor([list(token_ids)], device=device)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float()
        return [torch.log_softmax(logits, -1).gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1).tolist()]

    @property
    def sync_mode(self) -> str:
        mode = self.rollout.weight_sync
        return mode if mode != "auto" else ("tensor" if self.rollout.name == "hf" else "distributed")

    @staticmethod
    def _around_sync(fleet: Any, version: int, send) -> None:
        fleet.pause()
        try:
            send()
        finally:
            fleet.resume()
        fleet.check_version(version)

    def _write_sync_dir(self, buckets, hf_config: dict) -> str:
        """disk mode: the actor as a Hugging Face directory the servers reload (rank 0 writes it)."""
        from megappo.trainer.checkpointing import write_actor_hf_dir

        directory = os.path.abspath(os.path.expanduser(
            self.rollout.weight_sync_dir or os.path.join(self.cfg.trainer.default_local_dir, "weight_sync")))
        return write_actor_hf_dir(buckets, hf_config, self.cfg.actor_rollout_ref.model.path, directory,
                                  self.platform.dtype)

    def close(self) -> None:
        if self.rollout.name != "hf" and self.holder:
            for engine in {id(e): e for e in (self.engine, self.sync_engine) if e}.values():
                try:
                    engine.close_weight_group()
                except Exception:  # noqa: BLE001 - closing a group of a server that is going away
                    pass
        if self.servers is not None:
            self.servers.stop()
            self.servers = None
        self.engine = None


def step_seed(base: int, step: int) -> int:
    """The sampling seed of a step: a resumed run samples exactly what the uninterrupted one did."""
    return (base * 1_000_003 + step * 7_919) % (2**31 - 1)
