"""rollout.weight_sync=distributed for vLLM servers: the trainer's side of megappo's worker extension
(`ext/megappo_vllm_ext.py`, whose docstring has the stream's format and why a sync is one reload).

One group holds the trainer (rank 0) and every server's TP workers (server j of the group at ranks 1 + j * tp ...),
its store hosted by the trainer on `master_address` (`serving.weight_group`), so each bucket is broadcast once
whatever the number of servers. vLLM's own weight transfer (NCCL, CUDA IPC) has no CPU backend; this one runs on
gloo (CPU) or NCCL (GPU) alike. The group's timeout (rollout.sync_timeout_s) bounds each broadcast on both sides, so
it also bounds how long the trainer may take to export one bucket while the servers wait for it.
"""
from __future__ import annotations

import json
from typing import Any, Iterable, Optional, Sequence

import torch

from megappo.rollout.base import Bucket
from megappo.rollout.serving.http_client import post_in_background
from megappo.rollout.serving.process import free_port
from megappo.rollout.serving.weight_staging import flat_bucket

GROUP_NAME = "megappo_vllm_weight_sync"


def _rpc(client: Any, method: str, *args: Any, timeout: Optional[float]) -> tuple:
    """/collective_rpc `method` on `client`'s server in a background thread (its workers answer once the
    collective on this side is done); vLLM passes string arguments only. `timeout` None: no bound of its own."""
    body: dict = {"method": method, "args": [str(a) for a in args]}
    if timeout is not None:
        body["timeout"] = timeout
    return post_in_background(client.url + "/collective_rpc", body, None if timeout is None else timeout + 10,
                              client.api_key)


def without_extension(error: Exception) -> str:
    """What to do when `error` says the server has none of megappo's worker-extension methods ("" otherwise)."""
    # vLLM 0.32's worker: "'CPUWorker' object has no attribute 'megappo_receive'" (run_method: "... is not implemented")
    if not any(s in str(error) for s in ("has no attribute 'megappo_", "is not implemented")):
        return ""
    from megappo.rollout.vllm.server import EXTENSION_CLS, EXTENSION_DIR

    return (f"; the server runs without megappo's worker extension: start it with --worker-extension-cls "
            f"{EXTENSION_CLS} and {EXTENSION_DIR} on its PYTHONPATH (VLLMServer does both)")


def _results(post: tuple, client: Any, method: str) -> list:
    """The per-worker answers of a background `_rpc`, or RuntimeError naming the server."""
    thread, result = post
    thread.join()
    if "error" in result:
        error = result["error"]
        raise RuntimeError(f"vLLM server {client.url}: {method} failed: {error}{without_extension(error)}")
    answers = (result.get("answer") or {}).get("results")
    if not isinstance(answers, list) or not answers:
        raise RuntimeError(f"vLLM server {client.url}: {method} answered {result.get('answer')!r}")
    return answers


def connect(clients: Sequence[Any], *, tp_size: int, master_address: str, backend: str, timeout_s: float) -> Any:
    """The weight group of the trainer and `clients`' servers (each with `tp_size` workers); returns the trainer's
    process group. `timeout_s` bounds the rendezvous and every broadcast."""
    from megappo.rollout.serving.weight_group import init_weight_group

    port, world = free_port(master_address), 1 + len(clients) * tp_size
    posts = [_rpc(c, "megappo_join_group", master_address, port, 1 + j * tp_size, world, GROUP_NAME, backend,
                  timeout_s, timeout=timeout_s) for j, c in enumerate(clients)]
    try:
        group = init_weight_group(master_address, port, rank=0, world_size=world, group_name=GROUP_NAME,
                                  backend=backend, timeout=timeout_s)
    finally:
        for c, post in zip(clients, posts):
            post[0].join()
    for c, post in zip(clients, posts):
        _results(post, c, "megappo_join_group")
    return group


def leave(group: Any, clients: Sequence[Any]) -> None:
    """Destroy the group on every server that still answers, then here."""
    posts = [_rpc(c, "megappo_leave_group", timeout=10) for c in clients]
    for post in posts:
        post[0].join()
    torch.distributed.destroy_process_group(group)


def stream(group: Any, clients: Sequence[Any], buckets: Iterable[Bucket], *, backend: str, timeout_s: float,
           staging: list) -> tuple[int, list[dict]]:
    """Broadcast `buckets` into every server of the group: one `megappo_receive` per server, the stream (header,
    spec, data per bucket; then the end header). Returns (bytes sent, every worker's report). The end header goes
    even when the buckets fail to come (the export raised), so no server is left waiting; the error is re-raised."""
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    # the stream lasts as long as the export: `timeout_s` bounds each broadcast (on both sides), not the call
    posts = [_rpc(c, "megappo_receive", timeout=None) for c in clients]
    sent = 0

    def bcast(t: torch.Tensor) -> None:
        group.broadcast(t, 0).wait()

    try:
        for bucket in buckets:
            spec = json.dumps([[n, str(t.dtype).replace("torch.", ""), list(t.shape)] for n, t in bucket]).encode()
            flat = flat_bucket(bucket, staging)
            bcast(torch.tensor([len(spec), int(flat is not None)], dtype=torch.int64, device=device))
            bcast(torch.frombuffer(bytearray(spec), dtype=torch.uint8).to(device))
            for t in [flat] if flat is not None else [t.contiguous() for _, t in bucket]:
                bcast(t)
            sent += sum(t.numel() * t.element_size() for _, t in bucket)
    except BaseException:
        try:
            bcast(torch.zeros(2, dtype=torch.int64, device=device))
        except Exception:  # noqa: BLE001 - the group itself failed: the servers' broadcasts time out too
            pass
        for post in posts:
            post[0].join(timeout_s)
        raise
    bcast(torch.zeros(2, dtype=torch.int64, device=device))
    return sent, [r for c, post in zip(clients, posts) for r in _results(post, c, "megappo_receive")]


def refused(reports: Sequence[dict], partial: bool) -> str:
    """Why the servers' reports make the sync a failure ("" when they do not): a name the model lacks, or part of
    a layer (neither was loaded); a full sync that left some layer out is not refused here (vLLM logs it)."""
    unknown = sorted({n for r in reports for n in r.get("unknown", ())})
    incomplete = {k: v for r in reports for k, v in (r.get("incomplete") or {}).items()}
    problems = []
    if unknown:
        problems.append(f"the served model has no weights named {unknown}")
    if incomplete:
        what = "; ".join(f"{layer} also needs {missing}" for layer, missing in sorted(incomplete.items()))
        problems.append(f"these layers came in part and were left as they were ({'partial ' if partial else ''}"
                        f"syncs must send every tensor of a layer vLLM merges): {what}")
    return "; ".join(problems)
