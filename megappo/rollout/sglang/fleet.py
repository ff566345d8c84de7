"""Several SGLang servers behind the engine calls, balanced by the client, with no lost or doubled samples.

`generate` cuts a batch's rows (a prompt's `n` samples are `n` rows) into one contiguous share per live server and
sends the shares in parallel. A share that fails (connection refused, timeout, an answer with the wrong number of
rows, a row aborted by anyone but this fleet's `abort`, which partial rollouts use) goes again to another live
server; every row keeps its sampling seed (the sample's seed,
`megappo.rollout.seeds.sample_seed`: the request's seed, its prompt's index in the step's batch and its sample index),
so a retried sample is the one the failed server would have drawn, and a sample does not depend on which server,
request or data-parallel rank draws it (with SGLang's deterministic inference). A server that fails and then does
not answer `/health` is dropped with a warning; `revive`, when given, may restart it (the caller then gives it the
current weights) before it serves again. The result holds every row exactly once or the
call raises. With `router_url` (sglang-router in front of the servers) every row is a request of its own to the
router, which picks the server; failed rows are sent again.

Weights go to every live server at once: one weight group holds the trainer (rank 0) and each server's TP ranks
(server k at ranks 1 + k * tp ...), so each bucket is broadcast once whatever the number of servers.
"""
from __future__ import annotations

import itertools
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence

from megappo.rollout.base import RolloutEngine
from megappo.rollout.sampling import Completion, SamplingParams
from megappo.rollout.seeds import request_seeds
from megappo.rollout.sglang.engine import (Bucket, SGLangEngine, _join_all, _joined, _post_in_background,
                                           begin_update, broadcast_buckets, end_update)
from megappo.rollout.serving.http_client import http_json
from megappo.rollout.sglang.health import is_healthy
from megappo.rollout.serving.process import free_port
from megappo.rollout.sglang.vlm import row_images, sglang_prompts
from megappo.rollout.sglang.weight_staging import SharedStaging

if TYPE_CHECKING:
    from megappo.data.multimodal import MultiModalInputs


def _auth(engine: SGLangEngine) -> dict:
    """The keyword arguments that authenticate a request to `engine`'s server."""
    key = getattr(engine, "api_key", None)
    return {"api_key": key} if key else {}


class SGLangFleet(RolloutEngine):
    def __init__(self, urls: Sequence[str], *, timeout: float = 600, tp_size: int = 1, max_attempts: int = 3,
                 revive: Optional[Callable[[int], bool]] = None, engine_kwargs: Optional[dict] = None,
                 master_address: str = "127.0.0.1", backend: str = "gloo", router_url: Optional[str] = None,
                 health_check_interval_s: float = 30.0, health_check_timeout_s: float = 5.0,
                 max_concurrency: int = 256):
        if not urls:
            raise ValueError("an SGLang fleet needs at least one server URL")
        self.engine_kwargs = dict(engine_kwargs or {})
        self.timeout, self.tp_size, self.max_attempts, self.revive = timeout, tp_size, max_attempts, revive
        self.engines = [self._engine(u) for u in urls]
        self.alive = [True] * len(urls)
        self.master_address, self.backend = master_address, backend  # the weight group's store and transport
        # sglang-router: generation goes there one row per request (its requests hold one sampling_params map)
        self.router = self._engine(router_url) if router_url else None
        self.max_concurrency = max_concurrency
        self.health_check_interval_s, self.health_check_timeout_s = health_check_interval_s, health_check_timeout_s
        self._last_health_check = time.monotonic()
        self.retried_rows = 0  # rows answered by another server than the first one asked (since construction)
        self._group: Any = None
        self._group_servers: list[int] = []
        self._group_name = "megappo_fleet_weight_sync"
        self._flat_staging: list = []  # update_weights' flat send buffer, reused across syncs
        self._shm_staging = SharedStaging(slots=2)  # update_weights_from_tensor's shared buffers, idem
        self._aborting = threading.Event()  # abort() was called during the generate in flight
        # rollout.lora_sync=adapter: the served adapter (dir, version), which a restarted server is given again
        self._adapters: list[tuple[str, int]] = []

    def _engine(self, url: str) -> SGLangEngine:
        return SGLangEngine(url, timeout=self.timeout, tp_size=self.tp_size, **self.engine_kwargs)

    def set_servers(self, urls: Sequence[str], alive: Sequence[bool], router_url: Optional[str] = None) -> None:
        """The trainer's agreed view after restarts: these servers, these alive, this router. The weight group is
        rebuilt at the next sync (a restarted server, even on its old port, is a new process with no group)."""
        version = self.weight_version
        # a server this fleet saw dead is a new process now, even on its old port: its client starts afresh (no
        # adapter, no weight group), so nothing the old process held is assumed of it
        known = {e.url: e for e, ok in zip(self.engines, self.alive) if ok}
        self.engines = [known.get(u.rstrip("/")) or self._engine(u) for u in urls]
        self.alive = list(alive)
        fresh = [self.engines[k] for k in self.live() if self.engines[k].url not in known]
        for engine, (adapter_dir, version) in itertools.product(fresh, self._adapters):
            engine.load_lora_adapter(adapter_dir, version=version)  # a restarted server serves the base alone
        self.weight_version = version
        if router_url and (self.router is None or self.router.url != router_url.rstrip("/")):
            self.router = self._engine(router_url)
        self.close_weight_group()

    @property
    def weight_version(self) -> int:
        """The version of the weights the servers hold (completions carry it)."""
        return self.engines[0].weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        for e in self.engines:
            e.weight_version = version

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def live(self) -> list[int]:
        return [k for k, ok in enumerate(self.alive) if ok]

    # -- generation ------------------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, prompt_offset: int = 0,
                 multi_modal: Optional[Sequence[Optional["MultiModalInputs"]]] = None) -> list[list[Completion]]:
        """`params.n` completions per prompt, grouped by prompt in request order, each row exactly once.
        prompt_offset: the index of `prompts[0]` in the step's batch, which the samples' seeds follow.
        multi_modal: each prompt's images (None: a text prompt), sent as `sglang_prompts` makes them."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        prompts, images = sglang_prompts(prompts, multi_modal, self.engine_kwargs.get("image_token_id"))
        rows = [i for i in range(len(prompts)) for _ in range(params.n)]
        seeds = request_seeds(params, len(prompts), prompt_offset)
        done: dict[int, Completion] = {}
        pending = list(range(len(rows)))
        errors: list[str] = []
        self._aborting.clear()  # an abort() before this call ended an earlier one
        self._check_health_if_due()
        for _ in range(self.max_attempts):
            if self._aborting.is_set():
                break
            if self.router is not None:
                pending = self._send_via_router(pending, prompts, rows, seeds, params, done, errors, images)
            else:
                servers = self.live()
                if not servers:
                    break
                shares = [pending[j::len(servers)] for j in range(len(servers))]  # interleaved: both see each prompt
                results = self._send(servers, shares, prompts, rows, seeds, params, images)
                pending = []
                for k, share, result in zip(servers, shares, results):
                    if isinstance(result, BaseException):
                        errors.append(f"{self.engines[k].url}: {result}")
                        self._failed(k, result)
                        pending += share
                        continue
                    pending += self._accept(share, result, done, errors, self.engines[k].url)
            if not pending:
                break
            self.retried_rows += len(pending)
            pending.sort()
        if pending and self._aborting.is_set():  # rows not answered when the abort came: nothing generated yet
            for r in pending:
                done[r] = Completion(prompt_index=rows[r], output_ids=[], log_probs=[], finish_reason="abort",
                                     weight_version=self.weight_version)
            pending = []
        if pending:
            via = f"router {self.router.url}" if self.router is not None else \
                f"live servers: {[self.urls[k] for k in self.live()]}"
            raise RuntimeError(f"SGLang fleet: {len(pending)} of {len(rows)} samples got no answer after "
                               f"{self.max_attempts} attempts ({via}); "
                               "errors: " + "; ".join(errors[-4:]))
        grouped: list[list[Completion]] = [[] for _ in prompts]
        for r in range(len(rows)):
            grouped[rows[r]].append(done[r])
        return grouped

    def _accept(self, share: list[int], answers: list[Completion], done: dict, errors: list, url: str) -> list[int]:
        """Record a share's answers; the rows to send again: those aborted by someone else than `abort` (a pause of
        another client of the server), which are failures, not partial rollouts."""
        again = []
        for r, c in zip(share, answers):  # shares are disjoint: each row is answered by one server
            if c.finish_reason == "abort" and not self._aborting.is_set():
                again.append(r)
            else:
                done[r] = c
        if again:
            errors.append(f"{url}: {len(again)} rows aborted by the server")
        return again

    def _send(self, servers: list[int], shares: list[list[int]], prompts, rows, seeds, params, images=None
              ) -> list[Any]:
        """Each server's share in a thread of its own; a result per server, or the exception it raised."""
        results: list[Any] = [None] * len(servers)

        def run(j: int, k: int) -> None:
            share = shares[j]
            try:
                of_row = [rows[r] for r in share]
                results[j] = self.engines[k].generate_rows([prompts[i] for i in of_row], of_row,
                                                           [seeds[r] for r in share], params, partial=True,
                                                           image_data=row_images(images, of_row)) if share else []
            except Exception as e:  # noqa: BLE001 - the share is retried elsewhere, the error reported
                results[j] = e

        threads = [threading.Thread(target=run, args=(j, k), daemon=True) for j, k in enumerate(servers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results

    def _send_via_router(self, pending: list[int], prompts, rows, seeds, params, done: dict,
                         errors: list, images=None) -> list[int]:
        """Each pending row as a request of its own to the router (which spreads them over its workers and retries
        a failed one elsewhere); the rows that still failed."""
        router = self.router

        def one(r: int) -> Completion:
            return router.generate_rows([prompts[rows[r]]], [rows[r]], [seeds[r]], params, batched=False,
                                        partial=True, image_data=row_images(images, [rows[r]]))[0]

        failed = []
        with ThreadPoolExecutor(max_workers=max(1, min(self.max_concurrency, len(pending)))) as pool:
            for r, future in [(r, pool.submit(one, r)) for r in pending]:
                try:
                    failed += self._accept([r], [future.result()], done, errors, router.url)
                except Exception as e:  # noqa: BLE001 - retried, then reported
                    errors.append(f"{router.url}: {e}")
                    failed.append(r)
        return failed

    def _check_health_if_due(self) -> None:
        """Every `health_check_interval_s`, ask each live server's /health (`health_check_timeout_s`): a dead one is
        revived or dropped before it is given work, not after its requests time out."""
        if time.monotonic() - self._last_health_check < self.health_check_interval_s:
            return
        self._last_health_check = time.monotonic()
        for k in self.live():
            self._failed(k, "no answer to the periodic health check")  # keeps it when it answers now

    def _failed(self, k: int, error: Any) -> None:
        """A server's request failed: keep it if it is still healthy (the request itself was bad luck), else try to
        revive it, else drop it with a warning."""
        engine = self.engines[k]
        if is_healthy(engine.url, self.health_check_timeout_s, engine.api_key):
            return
        if self.revive is not None and self.revive(k):
            print(f"megappo rollout: SGLang server {engine.url} failed ({error}) and was restarted",
                  file=sys.stderr, flush=True)
            return
        self.alive[k] = False
        print(f"megappo rollout: SGLang server {engine.url} failed ({error}) and is dropped; "
              f"{len(self.live())} of {len(self.engines)} servers remain", file=sys.stderr, flush=True)

    # -- weights ---------------------------------------------------------------------------------------------------
    def update_weights_from_disk(self, model_path: str, *, version: Optional[int] = None) -> int:
        version = self.weight_version + 1 if version is None else version
        for k in self.live():
            self.engines[k].update_weights_from_disk(model_path, version=version)
        self.weight_version = version
        return version

    def load_lora_adapter(self, adapter_dir: str, *, version: int) -> int:
        """rollout.lora_sync=adapter: every live server serves the PEFT adapter in `adapter_dir` as the actor
        (`SGLangEngine.load_lora_adapter`); the router's requests name it too. A server restarted since serves no
        adapter until `set_servers` gives it the current one."""
        self._adapters = [(adapter_dir, version)]
        for k in self.live():
            self.engines[k].load_lora_adapter(adapter_dir, version=version)
        for e in self.engines + ([self.router] if self.router is not None else []):
            e.serve_as(f"megappo_v{version}")
        self.weight_version = version
        return version

    def connect_weight_group(self, *, backend: Optional[str] = None, master_address: Optional[str] = None,
                             master_port: Optional[int] = None, timeout_s: Optional[float] = None) -> Any:
        """One group: the trainer (rank 0) and every live server's TP ranks. The rendezvous store listens on
        `master_address` only (default: set at construction, else 127.0.0.1)."""
        from megappo.rollout.sglang.weight_group import init_weight_group

        backend = backend or self.backend
        master_address = master_address or self.master_address
        timeout_s = self.engines[0].sync_timeout if timeout_s is None else timeout_s
        port = master_port or free_port()
        servers = self.live()
        world = 1 + len(servers) * self.tp_size
        posts = []
        for j, k in enumerate(servers):
            body = {"master_address": master_address, "master_port": port, "rank_offset": 1 + j * self.tp_size,
                    "world_size": world, "group_name": self._group_name, "backend": backend}
            posts.append(_post_in_background(self.engines[k].url + "/init_weights_update_group", body,
                                             timeout_s, **_auth(self.engines[k])))
        self._group = init_weight_group(master_address, port, rank=0, world_size=world, group_name=self._group_name,
                                        backend=backend, timeout=timeout_s)
        self._group_servers = servers
        for thread, result in posts:
            _joined(thread, result, "init_weights_update_group")
        return self._group

    def update_weights(self, buckets: Iterable[Bucket], *, version: Optional[int] = None) -> int:
        """Stream checkpoint-named tensors into every server of the group: each bucket is announced to each server,
        then broadcast once (`sglang_engine.broadcast_buckets`)."""

        if self._group is None or self._group_servers != self.live():
            self.close_weight_group()
            self.connect_weight_group()
        version = self.weight_version + 1 if version is None else version
        engines = [self.engines[k] for k in self._group_servers]
        broadcast_buckets(engines, buckets, self._group, self._group_name, version, self._flat_staging)
        self.weight_version = version
        return version

    def update_weights_from_tensor(self, buckets: Iterable[Bucket], *, version: Optional[int] = None) -> int:
        """Colocated servers (same machine): each bucket goes by handle, not by value. CPU tensors are copied into
        shared-memory buffers kept across syncs (`weight_staging.SharedStaging`, two buckets' worth: the next
        bucket is staged while the servers copy out of the previous one); CUDA tensors go by CUDA IPC as they are.
        A slot is reused only after every server answered for it, i.e. copied it into its parameters."""
        import base64

        version = self.weight_version + 1 if version is None else version
        engines = [self.engines[k] for k in self.live()]
        staging = self._shm_staging
        begin_update(engines)
        pending: list[list] = [[] for _ in staging.buffers]  # per slot: the posts still reading it
        kept: list = [None] * len(pending)  # per slot: CUDA tensors sent as they are, alive until answered
        try:
            for i, bucket in enumerate(buckets):
                slot = i % len(pending)
                _join_all(pending[slot], "update_weights_from_tensor")
                staged = list(bucket) if any(t.is_cuda for _, t in bucket) else staging.stage(slot, bucket)
                kept[slot] = staged
                for e in engines:  # one payload per receiving rank: each unpickling releases one reference
                    body = {"serialized_named_tensors": [base64.b64encode(staging.handles(staged)).decode()
                                                         for _ in range(self.tp_size)],
                            "flush_cache": True, "weight_version": str(version)}
                    pending[slot].append(_post_in_background(e.url + "/update_weights_from_tensor", body,
                                                             e.sync_timeout, **_auth(e)))
        except BaseException:
            for posts in pending:
                _join_all(posts, "update_weights_from_tensor", check=False)
            raise
        for posts in pending:
            _join_all(posts, "update_weights_from_tensor")
        end_update(engines)
        self.weight_version = version
        return version

    def load_weights(self, buckets: Iterable[Bucket], *, version: int, mode: str = "distributed",
                     partial: bool = False) -> int:
        """The trainer's weight sync: one broadcast per bucket (distributed) or by handle (tensor: colocated).
        A server takes any subset of its parameters: `partial` needs nothing more."""
        send = self.update_weights_from_tensor if mode == "tensor" else self.update_weights
        return send(buckets, version=version)

    def needs_copies(self, mode: str) -> bool:
        # CUDA IPC hands the servers the tensors' own memory: views of the parameters would change under them
        return mode == "tensor" and self.backend == "nccl"

    def abort(self) -> None:
        """Abort every request in flight on every live server: `generate` answers at once, each sample with the
        tokens it has (finish_reason "abort"; rows not sent yet empty), for a partial rollout to continue."""
        self._aborting.set()  # before the servers answer: an aborted row is then ours, not a failure to retry
        for k in self.live():
            self.engines[k].abort()

    def close(self) -> None:
        self.shutdown_submitter()
        try:
            self.close_weight_group()
        except Exception:  # noqa: BLE001 - the group of a server that is going away
            pass

    # -- around a sync ---------------------------------------------------------------------------------------------
    def pause(self) -> None:
        for k in self.live():
            self.engines[k].pause()

    def resume(self) -> None:
        for k in self.live():
            self.engines[k].resume()

    def check_version(self, version: int) -> None:
        """Every live server reports `version` (GET /model_info), or RuntimeError naming the ones that do not."""
        wrong = {self.engines[k].url: got for k in self.live()
                 if str(got := self.engines[k].served_version()) != str(version)}
        if wrong:
            raise RuntimeError(f"after the weight sync to version {version} these servers report another: {wrong}")

    def prompt_log_probs(self, token_ids: Sequence[int]) -> list[list[float]]:
        """Each live server's log-prob of every token of `token_ids` after its prefix ([len - 1] per server):
        what `rollout.verify_sync` compares with the trainer's."""
        return [self.engines[k].prompt_log_probs(token_ids)[0] for k in self.live()]

    def sequence_log_probs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """`prompt_log_probs` of every sequence, the live servers each scoring a contiguous share at once."""
        from concurrent.futures import ThreadPoolExecutor

        live = self.live()
        if not live:
            raise RuntimeError("no live SGLang server to score the sequences")
        size = -(-len(sequences) // len(live))
        shares = [(k, sequences[i * size:(i + 1) * size]) for i, k in enumerate(live)]
        with ThreadPoolExecutor(max_workers=len(shares)) as pool:
            parts = list(pool.map(lambda share: self.engines[share[0]].sequence_log_probs(share[1]), shares))
        return [lp for part in parts for lp in part]

    def close_weight_group(self) -> None:
        import torch.distributed as dist

        if self._group is not None:
            for k in self._group_servers:
                e = self.engines[k]
                try:
                    http_json(e.url + "/destroy_weights_update_group", {"group_name": self._group_name},
                              timeout=10, **_auth(e))
                except Exception:  # noqa: BLE001 - a server that is gone has no group left
                    pass
            dist.destroy_process_group(self._group)
            self._group = None

