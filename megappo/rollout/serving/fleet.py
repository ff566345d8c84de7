"""Several rollout servers behind the engine calls, balanced by the client, with no lost or doubled samples: the
generation core every server engine shares (`ServerFleet`; SGLang's `SGLangFleet` adds its weight transport).

`generate` cuts a batch's rows (a prompt's `n` samples are `n` rows) into one contiguous share per live server and
sends the shares in parallel. A share that fails (connection refused, timeout, an answer with the wrong number of
rows, a row aborted by anyone but this fleet's `abort`, which partial rollouts use) goes again to another live
server; every row keeps its sampling seed (the sample's seed, `megappo.rollout.seeds.sample_seed`: the request's
seed, its prompt's index in the step's batch and its sample index), so a retried sample is the one the failed
server would have drawn, and a sample does not depend on which server, request or data-parallel rank draws it (with
the engine's deterministic inference). A server that fails and then fails the engine's health probe is dropped with
a warning; `revive`, when given, may restart it (the caller then gives it the current weights) before it serves
again. The result holds every row exactly once or the call raises. With `router_url` (a router in front of the
servers) every row is a request of its own to the router, which picks the server; failed rows are sent again.

Each server is reached through a client (`ServerClient`, made by the fleet's `client` factory): SGLang's is
`SGLangEngine`, vLLM's `megappo/rollout/vllm/client.py`.
"""
from __future__ import annotations

import itertools
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Sequence

from megappo.rollout.base import RolloutEngine
from megappo.rollout.sampling import Completion, SamplingParams, check_prompts
from megappo.rollout.seeds import request_seeds
from megappo.rollout.serving.http_client import HealthProbe

if TYPE_CHECKING:
    from megappo.data.multimodal import MultiModalInputs


class ServerClient(Protocol):
    """One server as the fleet drives it (SGLang's `SGLangEngine`, vLLM's client)."""

    url: str  # no trailing slash
    api_key: Optional[str]
    weight_version: int  # the version its completions carry; the fleet sets it

    def generate_rows(self, input_ids: Sequence[Sequence[int]], prompt_index: Sequence[int],
                      seeds: Sequence[Optional[int]], params: SamplingParams, *, batched: bool = True,
                      partial: bool = False, image_data: Optional[Sequence[Any]] = None) -> list[Completion]:
        """One completion per row (`input_ids[k]`, the prompt `prompt_index[k]`, sampled with `seeds[k]`), in row
        order; raises naming the server when it fails or answers another number of rows. `batched=False`: exactly
        one row as a plain request (a router's). `partial=True`: an aborted row answers with the tokens it has
        (finish_reason "abort") instead of raising. `image_data`: each row's images (the fleet's `_row_images`)."""
        ...

    def abort(self) -> None:
        """Abort every request in flight on the server; each answers with the tokens it has."""
        ...

    def pause(self) -> None:
        ...

    def resume(self) -> None:
        ...

    def check_version(self, version: int) -> None:
        """Raise RuntimeError naming the server when it does not serve `version`."""
        ...

    def prompt_log_probs(self, token_ids: Sequence[int]) -> list[list[float]]:
        """[[log p(token_ids[k] | token_ids[:k]) for k >= 1]]: one list, the server's."""
        ...

    def sequence_log_probs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """`prompt_log_probs` of every sequence: [len(seq) - 1] per sequence."""
        ...

    def update_weights_from_disk(self, model_path: str, *, version: Optional[int] = None) -> int:
        ...

    def load_lora_adapter(self, adapter_dir: str, *, version: int) -> int:
        ...

    def close(self) -> None:
        ...


ClientFactory = Callable[[str], ServerClient]  # a server's (or router's) URL -> its client


class ServerFleet(RolloutEngine):
    """The fleet over `urls`: `client(url)` makes each server's client (and the router's), `healthy(url, timeout,
    key)` probes a server. The engine's hooks: `ENGINE` (its name in messages), `_server_prompts` and `_row_images`
    (how prompts and images become the rows a server takes), `_on_new_servers` (what `set_servers` resets)."""

    ENGINE = "server"

    def __init__(self, urls: Sequence[str], client: ClientFactory, *, healthy: HealthProbe, max_attempts: int = 3,
                 revive: Optional[Callable[[int], bool]] = None, router_url: Optional[str] = None,
                 health_check_interval_s: float = 30.0, health_check_timeout_s: float = 5.0,
                 max_concurrency: int = 256):
        if not urls:
            raise ValueError(f"a fleet of {self.ENGINE} servers needs at least one server URL")
        self.client, self.healthy, self.max_attempts, self.revive = client, healthy, max_attempts, revive
        self.engines: list[ServerClient] = [client(u) for u in urls]
        self.alive = [True] * len(urls)
        # a router: generation goes there one row per request (sglang-router's requests hold one sampling_params map)
        self.router: Optional[ServerClient] = client(router_url) if router_url else None
        self.max_concurrency = max_concurrency
        self.health_check_interval_s, self.health_check_timeout_s = health_check_interval_s, health_check_timeout_s
        self._last_health_check = time.monotonic()
        self.retried_rows = 0  # rows answered by another server than the first one asked (since construction)
        self._aborting = threading.Event()  # abort() was called during the generate in flight
        # rollout.lora_sync=adapter: the served adapter (dir, version), which a restarted server is given again
        self._adapters: list[tuple[str, int]] = []
        self.log_dir: Optional[str] = None  # the run's server logs (`process.server_log_path`), quoted in errors

    # -- the engine's hooks ----------------------------------------------------------------------------------------
    def _server_prompts(self, prompts: Sequence[Sequence[int]],
                        multi_modal: Optional[Sequence[Optional["MultiModalInputs"]]]
                        ) -> tuple[list[list[int]], Optional[list]]:
        """The prompts as the servers take them, and each prompt's images in the servers' form (None: no images)."""
        raise NotImplementedError

    def _row_images(self, images: Optional[list], prompt_of_row: Sequence[int]) -> Optional[list]:
        """The images of each row (its prompt's) for `generate_rows`' `image_data`."""
        raise NotImplementedError

    def _on_new_servers(self) -> None:
        """`set_servers` changed the servers: drop what the old processes held (a weight group)."""

    # -- servers ---------------------------------------------------------------------------------------------------
    def set_servers(self, urls: Sequence[str], alive: Sequence[bool], router_url: Optional[str] = None) -> None:
        """The trainer's agreed view after restarts: these servers, these alive, this router."""
        version = self.weight_version
        # a server this fleet saw dead is a new process now, even on its old port: its client starts afresh (no
        # adapter, no weight group), so nothing the old process held is assumed of it
        known = {e.url: e for e, ok in zip(self.engines, self.alive) if ok}
        self.engines = [known.get(u.rstrip("/")) or self.client(u) for u in urls]
        self.alive = list(alive)
        fresh = [self.engines[k] for k in self.live() if self.engines[k].url not in known]
        for engine, (adapter_dir, version) in itertools.product(fresh, self._adapters):
            engine.load_lora_adapter(adapter_dir, version=version)  # a restarted server serves the base alone
        self.weight_version = version
        if router_url and (self.router is None or self.router.url != router_url.rstrip("/")):
            self.router = self.client(router_url)
        self._on_new_servers()

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
        multi_modal: each prompt's images (None: a text prompt), sent as `_server_prompts` makes them."""
        check_prompts(prompts)
        prompts, images = self._server_prompts(prompts, multi_modal)
        rows = [i for i in range(len(prompts)) for _ in range(params.n)]
        seeds = request_seeds(params, len(prompts), prompt_offset)
        done: dict[int, Completion] = {}
        pending = list(range(len(rows)))
        errors: list[str] = []
        failed: list[str] = []  # the URLs of the servers whose shares failed
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
                        failed.append(self.engines[k].url)
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
            dead = failed + [self.urls[k] for k, ok in enumerate(self.alive) if not ok]
            raise RuntimeError(f"{self.ENGINE} fleet: {len(pending)} of {len(rows)} samples got no answer after "
                               f"{self.max_attempts} attempts ({via}); "
                               "errors: " + "; ".join(errors[-4:]) + self._log_tails(dead))
        grouped: list[list[Completion]] = [[] for _ in prompts]
        for r in range(len(rows)):
            grouped[rows[r]].append(done[r])
        return grouped

    def _log_tails(self, urls: Sequence[str], lines: int = 20) -> str:
        """The last lines of the logs the run keeps of these servers (its own, and a `megappo rollout-server
        --log-dir` of the run's `servers/` folder); what names the cause when a server died."""
        from megappo.rollout.serving.process import server_log_path

        out = ""
        for url in list(dict.fromkeys(urls))[:4]:
            path = server_log_path(self.log_dir, self.ENGINE, url) if self.log_dir else None
            if path is None or not os.path.isfile(path):
                continue
            with open(path, errors="replace") as f:
                tail = "".join(f.readlines()[-lines:])
            out += f"\n--- {self.ENGINE} server {url}: the last {lines} lines of its log {path}:\n{tail}"
        return out

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
                                                           image_data=self._row_images(images, of_row)) if share else []
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
                                        partial=True, image_data=self._row_images(images, [rows[r]]))[0]

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
        """Every `health_check_interval_s`, probe each live server (`health_check_timeout_s`): a dead one is revived
        or dropped before it is given work, not after its requests time out."""
        if time.monotonic() - self._last_health_check < self.health_check_interval_s:
            return
        self._last_health_check = time.monotonic()
        for k in self.live():
            self._failed(k, "no answer to the periodic health check")  # keeps it when it answers now

    def _failed(self, k: int, error: Any) -> None:
        """A server's request failed: keep it if it is still healthy (the request itself was bad luck), else try to
        revive it, else drop it with a warning."""
        engine = self.engines[k]
        if self.healthy(engine.url, self.health_check_timeout_s, engine.api_key):
            return
        if self.revive is not None and self.revive(k):
            print(f"megappo rollout: {self.ENGINE} server {engine.url} failed ({error}) and was restarted",
                  file=sys.stderr, flush=True)
            return
        self.alive[k] = False
        print(f"megappo rollout: {self.ENGINE} server {engine.url} failed ({error}) and is dropped; "
              f"{len(self.live())} of {len(self.engines)} servers remain", file=sys.stderr, flush=True)

    # -- fan-out to every live server ------------------------------------------------------------------------------
    def update_weights_from_disk(self, model_path: str, *, version: Optional[int] = None) -> int:
        version = self.weight_version + 1 if version is None else version
        for k in self.live():
            self.engines[k].update_weights_from_disk(model_path, version=version)
        self.weight_version = version
        return version

    def load_lora_adapter(self, adapter_dir: str, *, version: int) -> int:
        """rollout.lora_sync=adapter: every live server serves the PEFT adapter in `adapter_dir` as the actor. A
        server restarted since serves no adapter until `set_servers` gives it the current one."""
        self._adapters = [(adapter_dir, version)]
        for k in self.live():
            self.engines[k].load_lora_adapter(adapter_dir, version=version)
        self.weight_version = version
        return version

    def abort(self) -> None:
        """Abort every request in flight on every live server: `generate` answers at once, each sample with the
        tokens it has (finish_reason "abort"; rows not sent yet empty), for a partial rollout to continue."""
        self._aborting.set()  # before the servers answer: an aborted row is then ours, not a failure to retry
        for k in self.live():
            self.engines[k].abort()

    def pause(self) -> None:
        for k in self.live():
            self.engines[k].pause()

    def resume(self) -> None:
        for k in self.live():
            self.engines[k].resume()

    def check_version(self, version: int) -> None:
        """Every live server serves `version`, or RuntimeError naming the ones that do not."""
        wrong = {}
        for k in self.live():
            try:
                self.engines[k].check_version(version)
            except RuntimeError as e:
                wrong[self.engines[k].url] = str(e)
        if wrong:
            raise RuntimeError(f"after the weight sync to version {version} these servers report another: {wrong}")

    def prompt_log_probs(self, token_ids: Sequence[int]) -> list[list[float]]:
        """Each live server's log-prob of every token of `token_ids` after its prefix ([len - 1] per server):
        what `rollout.verify_sync` compares with the trainer's."""
        return [self.engines[k].prompt_log_probs(token_ids)[0] for k in self.live()]

    def sequence_log_probs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """`prompt_log_probs` of every sequence, the live servers each scoring a contiguous share at once."""
        live = self.live()
        if not live:
            raise RuntimeError(f"no live {self.ENGINE} server to score the sequences")
        size = -(-len(sequences) // len(live))
        shares = [(k, sequences[i * size:(i + 1) * size]) for i, k in enumerate(live)]
        with ThreadPoolExecutor(max_workers=len(shares)) as pool:
            parts = list(pool.map(lambda share: self.engines[share[0]].sequence_log_probs(share[1]), shares))
        return [lp for part in parts for lp in part]

    def close(self) -> None:
        self.shutdown_submitter()
        for e in self.engines + ([self.router] if self.router is not None else []):
            try:
                e.close()
            except Exception:  # noqa: BLE001 - a client of a server that is going away
                pass
