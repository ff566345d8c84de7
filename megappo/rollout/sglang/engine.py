"""A rollout engine that is a client of an SGLang server (or router): the same calls as `HFEngine`.

Requests go to SGLang's native `POST /generate` with token ids (no text round trip); a prompt's `n` samples are sent
as `n` rows, each with its own `sampling_seed` when the request has a seed (the sample's seed, `megappo.rollout.seeds`,
as the in-process engine uses it). SGLang honours those seeds only when the server runs with
`--enable-deterministic-inference` (SGLang 0.5.23); otherwise sampling is not repeatable.
Weights reload from a Hugging Face directory (`/update_weights_from_disk`) or stream from the trainer
(`update_weights`): the trainer and the server's TP ranks share a process group (`init_weight_group`), and for each
bucket the server is told the names, dtypes and shapes while the trainer broadcasts the bucket, packed into one flat
buffer (SGLang's `flattened_bucket` format; tensor by tensor when mixed dtypes would misalign it).

Vision-language prompts go as `vlm.sglang_prompts` makes them: image tokens collapsed, images as `image_data`.

Log-probs are the server's `output_token_logprobs`; greedy ones equal `transformers`' log-softmax of the raw
logits (tools/sglang/check.py measures it).
"""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence

import torch

from megappo.rollout.base import RolloutEngine
from megappo.rollout.sampling import Completion, SamplingParams, check_prompts
from megappo.rollout.seeds import request_seeds
from megappo.rollout.serving.http_client import _http, http_json, register_api_key
from megappo.rollout.serving.http_client import post_in_background as _post_in_background
from megappo.rollout.sglang.routing import RouteLayout, decode_routed_experts
from megappo.rollout.serving.process import free_port
from megappo.rollout.serving.weight_group import unique_group_name
from megappo.rollout.sglang.vlm import ImageData, add_image_data, row_images, sglang_prompts

if TYPE_CHECKING:
    from megappo.data.multimodal import MultiModalInputs

Bucket = list[tuple[str, torch.Tensor]]


def _checked(answer: Any, what: str) -> Any:
    """`answer` of a weight-control endpoint, unless it lacks {"success": true} (then its message is raised)."""
    if not isinstance(answer, dict) or answer.get("success") is not True:
        raise RuntimeError(f"SGLang {what} failed: {answer.get('message') if isinstance(answer, dict) else answer}")
    return answer


def _joined(thread: threading.Thread, result: dict, what: str) -> Any:
    thread.join()
    if "error" in result:
        raise RuntimeError(f"SGLang {what} failed: {result['error']}")
    return _checked(result["answer"], what)


def _distributed_body(bucket: Bucket, group_name: str, version: int,
                      staging: list) -> tuple[dict, list[torch.Tensor]]:
    """The /update_weights_from_distributed request announcing `bucket`, and the tensors to broadcast after it in
    that order: one flat buffer (`flat_bucket`, kept in `staging` across calls) where the layout allows, else each
    tensor."""
    from megappo.rollout.serving.weight_staging import flat_bucket

    body = {"names": [n for n, _ in bucket], "dtypes": [str(t.dtype).replace("torch.", "") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket], "group_name": group_name, "flush_cache": True,
            "weight_version": str(version)}
    flat = flat_bucket(bucket, staging)
    if flat is not None:
        body["load_format"] = "flattened_bucket"
        return body, [flat]
    return body, [t.contiguous() for _, t in bucket]


def _join_all(posts: list, what: str, *, check: bool = True) -> None:
    """Wait for every background post in `posts` and empty it; then (check) raise the first failure. Either way no
    request is left running, so nothing it reads is released under it."""
    errors = []
    for post in posts:
        try:
            _joined(*post, what)
        except RuntimeError as e:
            errors.append(e)
    posts.clear()
    if errors and check:
        raise errors[0]


# SGLang 0.5.23's answer when it loaded new weights but refused to flush the prefix cache built with the old ones
_NOT_FLUSHED = "the cache was not flushed because requests are still running or queued"
_FLUSH_WITHIN_S = 5.0  # how long _flush_when_idle keeps trying


def _flush_when_idle(e: "SGLangEngine", what: str, error: str) -> None:
    """Flush the server's prefix cache after an update whose own flush was refused, as SGLang's refusal says to.

    The scheduler counts the batch it ran last as running until its next loop iteration: an update that reaches it
    in the iteration right after a generation (the heal's health probe, sent moments before a disk sync, with no
    begin_weight_update round trip between them) finds it busy, even though nothing runs (the servers are paused).
    Each /flush_cache request is handled in an iteration of its own, so a second one finds the scheduler idle."""
    deadline = time.monotonic() + _FLUSH_WITHIN_S
    delay = 0.005
    while True:
        try:
            _http(e.url + "/flush_cache", {}, timeout=e.sync_timeout, api_key=e.api_key)
            return
        except RuntimeError as refused:
            if "HTTP 400" not in str(refused) or time.monotonic() + delay > deadline:
                raise RuntimeError(f"SGLang {what} failed: {error}; flushing the cache then failed too: "
                                   f"{refused}") from None
        time.sleep(delay)
        delay = min(2 * delay, 0.5)


def begin_update(engines: Sequence["SGLangEngine"]) -> None:
    for e in engines:
        _checked(http_json(e.url + "/begin_weight_update", {"selector": "all"}, timeout=e.sync_timeout,
                           api_key=e.api_key), "begin_weight_update")


def end_update(engines: Sequence["SGLangEngine"]) -> None:
    for e in engines:
        _checked(http_json(e.url + "/end_weight_update", {}, timeout=e.sync_timeout, api_key=e.api_key),
                 "end_weight_update")


def broadcast_buckets(engines: Sequence["SGLangEngine"], buckets: Iterable[Bucket], group: Any, group_name: str,
                      version: int, staging: list) -> None:
    """One weight update of every server of `engines` (all of them ranks of `group`, this process rank 0): each
    bucket is announced to each server, then broadcast once (`_distributed_body`, its flat buffer kept in
    `staging`). The servers load a bucket while the next one is packed."""
    import torch.distributed as dist

    begin_update(engines)
    pending: list = []
    for bucket in buckets:
        # the previous broadcast has completed (its buffer is free) while the servers load that bucket
        body, tensors = _distributed_body(bucket, group_name, version, staging)
        _join_all(pending, "update_weights_from_distributed")
        pending = [_post_in_background(e.url + "/update_weights_from_distributed", body, e.sync_timeout,
                                       e.api_key) for e in engines]
        for t in tensors:
            dist.broadcast(t, src=0, group=group)
    _join_all(pending, "update_weights_from_distributed")
    end_update(engines)


class SGLangEngine(RolloutEngine):
    """One SGLang server (or router) as a rollout engine. `SGLangFleet` drives several through the per-server calls
    here (abort, pause, resume, served_version, prompt_log_probs)."""

    def __init__(self, url: str, *, timeout: float = 600, tp_size: int = 1, api_key: Optional[str] = None,
                 sync_timeout: float = 60, image_token_id: Optional[int] = None,
                 routes: Optional[RouteLayout] = None):
        self.url = url.rstrip("/")
        self.routes = routes  # a MoE model's layers: how to read `routed_experts` (router replay)
        self.image_token_id = image_token_id  # a vision-language model's <|image_pad|> id (see sglang_prompts)
        self.timeout = timeout  # a generation request (long batches take long)
        # weight-control calls and the weight group's rendezvous and collectives: a dead peer fails the sync in
        # seconds, not in `timeout`
        self.sync_timeout = sync_timeout
        self.api_key = api_key
        if api_key:  # every request to this server carries it (generate included); None keeps a started server's
            register_api_key(self.url, api_key)
        self.tp_size = tp_size  # the server's tensor-parallel ranks (each joins the weight group)
        self.weight_version = 0
        # rollout.lora_sync=adapter: the LoRA adapter the server serves the actor as; every request names it
        self.lora_name: Optional[str] = None
        self.request_fields: dict[str, str] = {}  # what every request adds: the served adapter's name (`serve_as`)
        self._group: Any = None
        self._group_name = unique_group_name("megappo_weight_sync")
        self._staging: list = []  # update_weights' flat send buffer, reused across syncs

    def _sampling_params(self, params: SamplingParams, seed: Optional[int]) -> dict[str, Any]:
        sp: dict[str, Any] = {
            "max_new_tokens": params.max_new_tokens,
            "temperature": 0.0 if params.is_greedy else params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "ignore_eos": params.ignore_eos,
            "no_stop_trim": True,  # keep the stop token in output_ids, as HFEngine does
        }
        if params.stop_token_ids:
            sp["stop_token_ids"] = list(params.stop_token_ids)
        if seed is not None:
            sp["sampling_seed"] = seed
        return sp

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, prompt_offset: int = 0,
                 multi_modal: Optional[Sequence[Optional["MultiModalInputs"]]] = None) -> list[list[Completion]]:
        """`params.n` completions per prompt (token ids), grouped by prompt in request order. prompt_offset: the
        index of `prompts[0]` in the step's batch, which the samples' seeds follow (as in `HFEngine.generate`).
        multi_modal: each prompt's images (None: a text prompt)."""
        check_prompts(prompts)
        prompts, images = sglang_prompts(prompts, multi_modal, self.image_token_id)
        rows = [i for i in range(len(prompts)) for _ in range(params.n)]
        seeds = request_seeds(params, len(prompts), prompt_offset)
        grouped: list[list[Completion]] = [[] for _ in prompts]
        for c in self.generate_rows([prompts[i] for i in rows], rows, seeds, params,
                                    image_data=row_images(images, rows)):
            grouped[c.prompt_index].append(c)
        return grouped

    def generate_rows(self, input_ids: Sequence[Sequence[int]], prompt_index: Sequence[int],
                      seeds: Sequence[Optional[int]], params: SamplingParams, *,
                      batched: bool = True, partial: bool = False,
                      image_data: Optional[Sequence[ImageData]] = None) -> list[Completion]:
        """One completion per row: `input_ids[k]` sampled with seed `seeds[k]` (the sample's seed, `row_seeds`;
        None: unseeded), so a row keeps its seed whichever server answers it. Raises RuntimeError naming the server
        when it fails, aborts a row, or answers with another number of rows than it was asked (which would silently
        drop samples).

        `batched=False` sends exactly one row as a plain (non-list) request: sglang-router takes only those (its
        request type has one `sampling_params` map, so a batch could not keep per-row seeds).

        `partial=True`: an aborted row (`/abort_request`) is answered with the tokens and log-probs it has,
        finish_reason "abort", for a partial rollout to continue, instead of raising.

        `image_data`: each row's images (`sglang_prompts`; its rows' image tokens collapsed to one per image)."""
        if batched:
            body = {"input_ids": [list(p) for p in input_ids],
                    "sampling_params": [self._sampling_params(params, seed) for seed in seeds]}
        else:
            if len(input_ids) != 1:
                raise ValueError("an unbatched request holds exactly one row")
            body = {"input_ids": list(input_ids[0]), "sampling_params": self._sampling_params(params, seeds[0])}
        add_image_data(body, image_data, batched)
        body.update(return_logprob=True, logprob_start_len=-1)
        if params.return_routed_experts:
            body["return_routed_experts"] = True
        body.update({k: [v] * len(input_ids) if batched else v for k, v in self.request_fields.items()})
        answer = http_json(self.url + "/generate", body, timeout=self.timeout)
        if isinstance(answer, dict):
            answer = [answer]
        if not isinstance(answer, list) or len(answer) != len(input_ids):
            got = len(answer) if isinstance(answer, list) else type(answer).__name__
            raise RuntimeError(f"SGLang {self.url}/generate answered {got} rows for {len(input_ids)} requests")
        out = []
        for i, item in zip(prompt_index, answer):
            meta = item["meta_info"]
            reason = (meta.get("finish_reason") or {}).get("type", "length")
            if reason == "abort" and not partial:
                raise RuntimeError(f"SGLang {self.url} aborted a request: {meta.get('finish_reason')}")
            out.append(Completion(
                prompt_index=i, output_ids=list(item["output_ids"]),
                log_probs=[lp for lp, *_ in meta.get("output_token_logprobs", [])],
                finish_reason=reason if reason in ("stop", "abort") else "length",
                weight_version=self.weight_version, extra={"sglang_weight_version": meta.get("weight_version")},
                routed_experts=self._routes(meta) if params.return_routed_experts else None))
        return out

    def _routes(self, meta: dict) -> Optional[torch.Tensor]:
        if self.routes is None:
            return None  # a dense model: nothing to replay (the trainer refuses replay on one)
        if "routed_experts" not in meta:
            raise RuntimeError(f"SGLang {self.url} returned no routed_experts: start it with "
                               "--enable-return-routed-experts (rollout.enable_rollout_routing_replay does so for the "
                               "servers megappo starts)")
        return decode_routed_experts(meta["routed_experts"], self.routes)

    def serve_as(self, adapter_name: str) -> None:
        """Every later request names the LoRA adapter `adapter_name` (SGLang's `lora_path`): the actor as served."""
        self.lora_name = adapter_name
        self.request_fields = {"lora_path": adapter_name}

    def load_lora_adapter(self, adapter_dir: str, *, version: int) -> int:
        """rollout.lora_sync=adapter: serve the PEFT adapter directory `adapter_dir` (on a filesystem the server
        reads) as `megappo_v<version>` over the base it loaded, unload the previous one, and stamp the server's
        weight version; later requests name the adapter (`lora_path`). The server runs with --enable-lora."""
        name = f"megappo_v{version}"
        _checked(http_json(self.url + "/load_lora_adapter", {"lora_name": name, "lora_path": adapter_dir},
                           timeout=self.sync_timeout, api_key=self.api_key), f"load_lora_adapter({adapter_dir})")
        previous = self.lora_name
        self.serve_as(name)
        if previous is not None and previous != name:
            _checked(http_json(self.url + "/unload_lora_adapter", {"lora_name": previous}, timeout=self.sync_timeout,
                               api_key=self.api_key), f"unload_lora_adapter({previous})")
        http_json(self.url + "/update_weight_version", {"new_version": str(version), "abort_all_requests": False},
                  timeout=self.sync_timeout, api_key=self.api_key)
        self.weight_version = version
        return version

    def update_weights_from_disk(self, model_path: str, *, version: Optional[int] = None) -> int:
        """Reload the server's weights from a HF directory of the same architecture."""
        version = self.weight_version + 1 if version is None else version
        what = f"update_weights_from_disk({model_path})"
        try:
            answer = http_json(self.url + "/update_weights_from_disk",
                               {"model_path": model_path, "weight_version": str(version)}, timeout=self.timeout,
                               api_key=self.api_key)
        except RuntimeError as e:
            if _NOT_FLUSHED not in str(e):
                raise
            _flush_when_idle(self, what, str(e))  # the weights and their version are in
        else:
            _checked(answer, what)
        self.weight_version = version
        return version

    def connect_weight_group(self, *, backend: str = "gloo", master_address: str = "127.0.0.1",
                             master_port: Optional[int] = None, timeout_s: Optional[float] = None) -> Any:
        """Create the process group (trainer = rank 0, server TP ranks 1..tp) that `update_weights` streams over."""
        from megappo.rollout.serving.weight_group import init_weight_group

        port = master_port or free_port()
        body = {"master_address": master_address, "master_port": port, "rank_offset": 1,
                "world_size": self.tp_size + 1, "group_name": self._group_name, "backend": backend}
        timeout_s = self.sync_timeout if timeout_s is None else timeout_s
        thread, result = _post_in_background(self.url + "/init_weights_update_group", body, timeout_s, self.api_key)
        self._group = init_weight_group(master_address, port, rank=0, world_size=self.tp_size + 1,
                                        group_name=self._group_name, backend=backend, timeout=timeout_s)
        _joined(thread, result, "init_weights_update_group")
        return self._group

    def update_weights(self, buckets: Iterable[Bucket], *, version: Optional[int] = None) -> int:
        """Stream checkpoint-named tensors (buckets, as `iter_hf_weights` yields them) into the server."""

        if self._group is None:
            self.connect_weight_group()
        version = self.weight_version + 1 if version is None else version
        broadcast_buckets([self], buckets, self._group, self._group_name, version, self._staging)
        self.weight_version = version
        return version

    def load_weights(self, buckets: Iterable[Bucket], *, version: int, mode: str = "distributed",
                     partial: bool = False) -> int:
        """The trainer's weight sync into this one server: a broadcast per bucket. Colocated servers take weights by
        handle (mode "tensor") through `SGLangFleet`, which keeps the shared staging buffers."""
        if mode != "distributed":
            raise ValueError(f"SGLangEngine loads weights with mode 'distributed' (or from disk), not {mode!r}: "
                             "use SGLangFleet for rollout.weight_sync=tensor")
        return self.update_weights(buckets, version=version)

    def abort(self) -> None:
        """Abort every request in flight on the server; each answers with the tokens it has."""
        http_json(self.url + "/abort_request", {"abort_all": True}, timeout=self.sync_timeout, api_key=self.api_key)

    def pause(self) -> None:
        """Stop generation on the server (aborting what a timed-out client may have left running)."""
        http_json(self.url + "/pause_generation", {"mode": "abort"}, timeout=self.sync_timeout, api_key=self.api_key)

    def resume(self) -> None:
        http_json(self.url + "/continue_generation", {}, timeout=self.sync_timeout, api_key=self.api_key)

    def served_version(self) -> Any:
        """The weight version the server reports (GET /model_info)."""
        return (http_json(self.url + "/model_info", timeout=30, api_key=self.api_key) or {}).get("weight_version")

    def check_version(self, version: int) -> None:
        got = self.served_version()
        if str(got) != str(version):
            raise RuntimeError(f"after the weight sync to version {version} the server {self.url} reports {got}")

    def prompt_log_probs(self, token_ids: Sequence[int]) -> list[list[float]]:
        """The server's log-prob of every token of `token_ids` after its prefix ([1][len - 1])."""
        body = {"input_ids": list(token_ids), "return_logprob": True, "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
        body.update(self.request_fields)
        answer = http_json(self.url + "/generate", body, timeout=self.timeout, api_key=self.api_key)
        if isinstance(answer, list):
            answer = answer[0]
        return [[lp for lp, *_ in answer["meta_info"]["input_token_logprobs"][1:]]]

    def sequence_log_probs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """`prompt_log_probs` of every sequence in one batched request."""
        if not sequences:
            return []
        body = {"input_ids": [list(map(int, s)) for s in sequences], "return_logprob": True, "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
        body.update(self.request_fields)
        answers = http_json(self.url + "/generate", body, timeout=self.timeout, api_key=self.api_key)
        return [[lp for lp, *_ in a["meta_info"]["input_token_logprobs"][1:]] for a in answers]

    def close(self) -> None:
        self.shutdown_submitter()
        self.close_weight_group()

    def close_weight_group(self) -> None:
        """Leave the weight group on this side (the server's ranks drop theirs with the server)."""
        import torch.distributed as dist

        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None
