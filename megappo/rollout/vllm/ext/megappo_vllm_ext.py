"""megappo's vLLM worker extension: the server side of rollout.weight_sync=distributed for vLLM servers.

Loaded by vLLM inside each worker (`--worker-extension-cls megappo_vllm_ext.WeightReceiver`, this directory on the
server's PYTHONPATH: `VLLMServer`); its methods are mixed into the worker and reached through the dev-mode
`/collective_rpc`. It runs in vLLM's own environment: standard library, torch and vllm only, nothing of megappo.

The trainer (rank 0) and every server's TP workers (rank `rank_offset + worker rank`) share one process group
(`megappo_join_group`; the trainer hosts its store: megappo.rollout.serving.weight_group). A sync is one
`megappo_receive` call per server, answered when the trainer ends the stream; on the group, per bucket:
  1. a header, int64[2]: (length of the bucket's JSON spec in bytes, 1 if the data is one flat byte buffer);
     (0, 0) ends the stream;
  2. the spec, uint8 JSON: [[name, dtype, shape], ...] (checkpoint names, as in the HF safetensors);
  3. the data: one flat buffer (the tensors back to back, no padding) or one broadcast per tensor.

Why one `reload_weights` call per sync and not one per bucket: vLLM's in-place reload (model_loader/reload) puts
every layer back in checkpoint layout on the meta device, loads, and then processes a layer (on CPU: repacks its
linear weights) once all of its elements came; a layer none came for keeps its kernel tensors, but a layer only
*some* came for is materialised uninitialised and processed with the rest left as garbage. So a call may take a
subset of the layers, never part of one, and a bucket boundary falls anywhere (q_proj in one bucket, k_proj and
v_proj, the rest of qkv_proj, in the next). Hence one call fed by the broadcasts (a generator), and each layer's
tensors held back until all of them came: a partial sync that sends part of a merged layer (q_proj without k_proj)
leaves that layer as it was and is reported (`incomplete`), as is a name the model does not have (`unknown`), which
is never handed to the loader (vLLM's Qwen2 raises KeyError mid-reload, which would leave layers on the meta device).
"""
from __future__ import annotations

import json
from datetime import timedelta
from typing import Any, Iterator

import torch

_END = (0, 0)


def _layer_names(model: Any, tied: bool) -> tuple[dict[str, str], dict[str, frozenset]]:
    """Checkpoint name -> the vLLM layer (module path) it loads into, and each layer's checkpoint names. Merged layers
    (`packed_modules_mapping`: qkv_proj from q/k/v_proj, gate_up_proj from gate/up_proj) take several names."""
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    layer_of: dict[str, str] = {}
    names: dict[str, set] = {}
    for pname, _ in model.named_parameters():
        name = pname.replace(".base_layer.", ".")  # a layer LoRA wraps (--enable-lora) keeps its checkpoint name
        module, _, leaf = name.rpartition(".")
        parent, _, local = module.rpartition(".")
        parts = packed.get(local)
        for hf in ([f"{parent}.{p}.{leaf}" for p in parts] if parts else [name]):
            layer_of[hf] = module
            names.setdefault(module, set()).add(hf)
    if tied:
        layer_of.setdefault("lm_head.weight", "")  # the tied head: vLLM's loader skips it, nothing to wait for
    return layer_of, {k: frozenset(v) for k, v in names.items()}


def _sharing_layers(model: Any) -> list:
    """Layers whose weight is another layer's (a tied LM head is the embedding's). The reload processes a layer only
    when something is loaded into it, and on CPU processing packs a copy of the weight for the GEMM: a tied head
    would go on computing logits with the old embedding (measured: greedy tokens neither model's)."""
    seen, sharing = set(), []
    for layer in model.modules():
        own = [id(p) for p in layer.parameters(recurse=False)]
        method = getattr(layer, "quant_method", None)
        if any(i in seen for i in own) and hasattr(method, "process_weights_after_loading"):
            sharing.append(layer)
        seen.update(own)
    return sharing


def _new_group(host: str, port: int, rank: int, world_size: int, group_name: str, backend: str,
               timeout: timedelta) -> Any:
    """Join the trainer's group: a client of its TCP store, prefixed by the group's name, as the trainer's side
    (megappo.rollout.serving.weight_group.init_weight_group) makes it."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    store = PrefixStore(group_name, torch.distributed.TCPStore(host, port, world_size, False, timeout))
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class WeightReceiver:
    """Mixed into vLLM's worker class (`self` is the worker: `self.rank`, `self.model_runner`)."""

    def megappo_join_group(self, host: str, port: str, rank_offset: str, world_size: str, group_name: str,
                           backend: str, timeout_s: str) -> dict:
        """Join the weight group as rank `rank_offset + self.rank`; a group joined before is left first."""
        self.megappo_leave_group()
        rank = int(rank_offset) + int(self.rank)
        self._megappo_device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
        self._megappo_pg = _new_group(host, int(port), rank, int(world_size), group_name, backend,
                                      timedelta(seconds=float(timeout_s)))
        model = self.model_runner.get_model()
        tied = bool(getattr(self.model_runner.model_config.hf_config, "tie_word_embeddings", False))
        self._megappo_layers = _layer_names(model, tied)
        return {"rank": rank}

    def megappo_leave_group(self) -> dict:
        pg = getattr(self, "_megappo_pg", None)
        if pg is not None:
            self._megappo_pg = None
            torch.distributed.destroy_process_group(pg)
        return {"left": pg is not None}

    def megappo_receive(self) -> dict:
        """Take one sync's stream (module docstring) and load it with one in-place reload; returns what was
        loaded, the names the model does not have and the layers only part of which came (neither is loaded)."""
        if getattr(self, "_megappo_pg", None) is None:
            raise RuntimeError("megappo_receive before megappo_join_group: this worker is in no weight group")
        report: dict = {"tensors": 0, "bytes": 0, "unknown": [], "incomplete": {}}
        stream = self._megappo_stream(report)
        try:
            self.model_runner.reload_weights(weights_iterator=self._megappo_whole_layers(stream, report))
        finally:
            for _ in stream:  # a loader that stopped early or failed: the trainer's broadcasts still come
                pass
        self._megappo_process_sharing()
        return report

    def megappo_reload(self, weights_path: str) -> dict:
        """rollout.weight_sync=disk: vLLM's in-place reload from a Hugging Face directory, then the layers that
        share a reloaded weight processed again (`_sharing_layers`: a bare `reload_weights` leaves a tied head's
        logits the old embedding's on CPU)."""
        self.model_runner.reload_weights(weights_path=weights_path)
        self._megappo_process_sharing()
        return {"reloaded": weights_path}

    def _megappo_process_sharing(self) -> None:
        for layer in _sharing_layers(self.model_runner.get_model()):
            layer.quant_method.process_weights_after_loading(layer)

    def _megappo_broadcast(self, t: torch.Tensor) -> torch.Tensor:
        self._megappo_pg.broadcast(t, 0).wait()
        return t

    def _megappo_stream(self, report: dict) -> Iterator[tuple[str, torch.Tensor]]:
        """The (name, tensor) pairs as the trainer broadcasts them, bucket by bucket, until the end header. Each
        bucket lands in fresh memory: the reload holds the tensors of a layer until the layer is complete."""
        dev = self._megappo_device
        while True:
            spec_len, flat = (int(x) for x in self._megappo_broadcast(torch.zeros(2, dtype=torch.int64, device=dev)))
            if (spec_len, flat) == _END:
                return
            spec = json.loads(bytes(self._megappo_broadcast(
                torch.empty(spec_len, dtype=torch.uint8, device=dev)).cpu().tolist()))
            dtypes = [getattr(torch, d) for _, d, _ in spec]
            sizes = [torch.Size(s).numel() * torch.empty((), dtype=d).element_size()
                     for (_, _, s), d in zip(spec, dtypes)]
            if flat:
                buf, start = self._megappo_broadcast(torch.empty(sum(sizes), dtype=torch.uint8, device=dev)), 0
                for (name, _, shape), d, n in zip(spec, dtypes, sizes):
                    yield name, buf[start:start + n].view(d).view(shape)
                    start += n
            else:
                for (name, _, shape), d in zip(spec, dtypes):
                    yield name, self._megappo_broadcast(torch.empty(shape, dtype=d, device=dev))
            report["bytes"] += sum(sizes)

    def _megappo_whole_layers(self, stream: Iterator, report: dict) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass on each layer's tensors once all of them came (module docstring); names of no layer are left out."""
        layer_of, names_of = self._megappo_layers
        waiting: dict[str, dict] = {}
        for name, t in stream:
            layer = layer_of.get(name)
            if layer is None:
                report["unknown"].append(name)
                continue
            if not layer:
                report["tensors"] += 1
                yield name, t
                continue
            got = waiting.setdefault(layer, {})
            got[name] = t
            if len(got) == len(names_of[layer]):
                for item in waiting.pop(layer).items():
                    report["tensors"] += 1
                    yield item
        report["incomplete"] = {layer: sorted(names_of[layer] - set(got)) for layer, got in waiting.items()}
