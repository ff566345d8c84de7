"""Router replay for MoE models: the routes (top-k experts) given per token, used instead of the router's own.

Routes of a batch are `ModelBatch.routes`, [B, T, L, k] (uint8 up to 256 experts, else int16): for each token
column, each MoE layer (in model order, L = the model's MoE layers) and each of the k choices, a global expert id.
A row's route is "valid" where its k experts are distinct; padding and a sequence's last token (whose route no
output depends on) hold zeros there and are replayed with experts 0..k-1.

`install(model_chunks)` gives each chunk's megatron routers a replay state (megatron-core's `RouterReplay`, kept
per model: megatron's own list is global and would mix the actor's routers with the reference's) and the chunk a
`Replayer`; from then on the forward step (`megappo.models.compute._forward_step`) asks `before_forward` for each
micro-batch:

- the micro-batch carries routes: every router of the chunk replays its layer's routes, laid out as the layout
  lays out the tokens (padded rows, a pack, a CP rank's chunks, a TP rank's sequence-parallel share); the router
  also takes its own top-k beside them and counts where the two agree (`agreement`);
- it carries none: the routers route as usual; with recording on (`set_recording`) they keep their top-k, which
  `keep_recorded` turns into the batch's [B, T, L, k] after the pass and `take_recorded` hands over (R2: the
  trainer's first pass records, the later passes replay).

Routes are global expert ids, so every TP / EP rank replays the same indices; each pipeline stage replays its own
layers (the router's global layer number picks the routes' layer). With activation recompute the backward's
recomputed forwards replay each micro-batch's routes again, in the order the forwards ran.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

import torch
from torch import nn

__all__ = ["Replayer", "install", "replayer_of", "before_forward", "after_forward", "agreement", "reset_agreement",
           "set_recording", "recorded_routes", "keep_recorded", "take_recorded", "routes_dtype", "distinct",
           "token_sources", "batch_routes", "routes_to_json", "routes_from_json"]

_ATTR = "megappo_router_replay"


def routes_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype holding every expert id (uint8 up to 256 experts)."""
    return torch.uint8 if num_experts <= 256 else torch.int16


def _moe_pattern(config: Any) -> list[bool]:
    freq, n = config.moe_layer_freq, config.num_layers
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(n)]
    return [bool(x) for x in freq]


def _replay_class():
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    class CountingReplay(RouterReplay):
        """megatron's replay state of one router that also counts where its own top-k agrees with the replayed
        one, on the valid routes only (`valid` [tokens] bool, set per micro-batch)."""

        def __init__(self) -> None:
            super().__init__()
            RouterReplay.global_router_replay_instances.remove(self)  # one per model, not megatron's global list
            self.valid: Optional[torch.Tensor] = None
            self.agree = 0
            self.total = 0

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            if self.router_replay_action == RouterReplayAction.REPLAY_FORWARD and _in_backward():
                # activation recompute: the backward re-runs each micro-batch's forward in the order they ran
                top = self.replay_backward_list.pop(0).to(scores.device)
                return scores.gather(1, top), top
            out = super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
            if self.router_replay_action == RouterReplayAction.REPLAY_FORWARD and self.valid is not None:
                with torch.no_grad():
                    _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                    same = (own.sort(-1).values == out[1].sort(-1).values).all(-1) & self.valid
                    self.agree += int(same.sum())
                    self.total += int(self.valid.sum())
            return out

    return CountingReplay, RouterReplayAction


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


@dataclass
class _Router:
    state: Any  # its CountingReplay
    layer: int  # index into the routes' L axis


class Replayer:
    """One model chunk's routers and what they replay or record; see the module doc."""

    def __init__(self, chunk: nn.Module):
        from megatron.core.transformer.moe.router import TopKRouter

        cls, self._action = _replay_class()
        config = chunk.config
        if getattr(config, "moe_router_fusion", False):
            raise ValueError("router replay needs megatron's unfused top-k (its fused kernel takes no replayed "
                             "routes): set moe_router_fusion=false")
        pattern = _moe_pattern(config)
        moe_index = {i + 1: sum(pattern[:i]) for i in range(len(pattern)) if pattern[i]}  # layer number -> l
        self.num_layers, self.topk = sum(pattern), int(config.moe_router_topk)
        self.sequence_parallel = bool(getattr(config, "sequence_parallel", False))
        self.recompute = getattr(config, "recompute_granularity", None) is not None
        self.routers: list[_Router] = []
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                module.router_replay = cls()
                self.routers.append(_Router(module.router_replay, moe_index[int(module.layer_number)]))
        self.recording = False
        self.recorded: Optional[torch.Tensor] = None
        self._records: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}  # id(mb) -> (sources, per router)

    def replay(self, routes: torch.Tensor, sources: torch.Tensor) -> None:
        """Set every router's target: routes [b, T, L, k] of the micro-batch, sources [n] its flat token index of
        each token the routers see, in their order (-1: tail padding)."""
        flat = routes.reshape(-1, routes.shape[2], routes.shape[3])
        picked = flat.index_select(0, sources.clamp(min=0)).long()  # [n, L, k]
        valid = (sources >= 0).unsqueeze(-1) & distinct(picked)  # [n, L]
        filler = torch.arange(self.topk, device=picked.device).expand_as(picked[:, 0])
        # a training pass with activation recompute: the backward takes each micro-batch's targets again, first in
        # first out (megatron's replay_backward_list); otherwise only the current micro-batch's are kept
        queue = self.recompute and torch.is_grad_enabled()
        for r in self.routers:
            target = torch.where(valid[:, r.layer].unsqueeze(-1), picked[:, r.layer], filler)
            if not queue:
                r.state.clear_indices()
            r.state.set_target_indices(target)
            r.state.valid = valid[:, r.layer]
            r.state.set_router_replay_action(self._action.REPLAY_FORWARD)

    def route_freely(self) -> None:
        for r in self.routers:
            r.state.clear_indices()
            r.state.valid = None
            if self.recording:
                r.state.set_router_replay_action(self._action.RECORD)
            else:
                r.state.clear_router_replay_action()

    def keep_record(self, mb_id: int, sources: torch.Tensor) -> None:
        if self.recording and self.routers:
            self._records[mb_id] = (sources, [r.state.get_recorded_indices().detach() for r in self.routers])


def distinct(routes: torch.Tensor) -> torch.Tensor:
    """[..., k] -> [...] bool: the k experts are distinct (a recorded route; all zeros is no route)."""
    s = routes.sort(-1).values
    return (s[..., 1:] != s[..., :-1]).all(-1)


def install(model_chunks: Sequence[nn.Module]) -> list[Replayer]:
    """Give every chunk's routers a replay state (idempotent); [] for a dense model."""
    from megappo.models.builder import unwrap

    out = []
    for chunk in model_chunks:
        inner = unwrap(chunk)
        if not getattr(inner.config, "num_moe_experts", None):
            return []
        if getattr(inner, _ATTR, None) is None:
            setattr(inner, _ATTR, Replayer(inner))
        out.append(getattr(inner, _ATTR))
    return out


def replayer_of(model: nn.Module) -> Optional[Replayer]:
    from megappo.models.builder import unwrap

    return getattr(unwrap(model), _ATTR, None)


def token_sources(mb: Any, layout: Any, sequence_parallel: bool = False) -> torch.Tensor:
    """[n] long: for each token the model's routers see (in their order: sequence-major [s, b], this rank's share),
    its flat index into the micro-batch's [b, T] columns; -1 for a pack's tail padding."""
    from megappo.models.layout.context_parallel import positions
    from megappo.models.layout.packing import pack_micro_batch

    b, t = mb.input_ids.shape
    flat = torch.arange(b * t, device=mb.input_ids.device).view(b, t)
    probe = replace(mb, input_ids=flat, train=None, multi_modal=None, routes=None)
    if layout.pack is not None:
        src = pack_micro_batch(probe, pack_len=layout.pack.num_tokens, pad_token_id=-1).input_ids  # [1, n]
    else:
        src, _ = probe.left_aligned()  # [b, s]
        split = getattr(layout, "split", None)
        if split is not None:  # context parallel: this rank's two chunks of the right-padded rows
            src = torch.nn.functional.pad(src, (0, split.seq_len - t), value=-1)
            ps = _cp_state(split)
            src = src.index_select(1, positions(split.seq_len, ps[0], ps[1], src.device))
    src = src.t().reshape(-1)
    if sequence_parallel:
        from megatron.core import parallel_state as mpu

        src = src.chunk(mpu.get_tensor_model_parallel_world_size())[mpu.get_tensor_model_parallel_rank()]
    return src


def _cp_state(split: Any) -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_world_size(split.group), dist.get_rank(split.group)


def before_forward(model: nn.Module, mb: Any, layout: Any) -> None:
    """The forward step's call before the model runs on micro-batch `mb` in `layout` (a no-op without replay)."""
    rep = replayer_of(model)
    if rep is None or not rep.routers:
        return
    if mb.routes is None:
        rep.route_freely()
        if rep.recording:
            rep._records[id(mb)] = (token_sources(mb, layout, rep.sequence_parallel), [])
        return
    rep.replay(mb.routes.to(mb.input_ids.device), token_sources(mb, layout, rep.sequence_parallel))


def after_forward(model: nn.Module, mb: Any) -> None:
    """The forward step's call after the model ran on `mb`: keep what the routers recorded (R2)."""
    rep = replayer_of(model)
    if rep is not None and rep.recording and id(mb) in rep._records:
        rep.keep_record(id(mb), rep._records[id(mb)][0])


def set_recording(model_chunks: Sequence[nn.Module], on: bool) -> None:
    for rep in install(model_chunks):
        rep.recording, rep._records = on, {}


def recorded_routes(model_chunks: Sequence[nn.Module], plan: Any, batch: Any, pp_group: Any = None
                    ) -> Optional[torch.Tensor]:
    """The routes the routers chose in the pass over `plan` (recording on), as the batch's [B, T, L, k]; every
    pipeline stage's layers and every rank's tokens (summed over the pipeline, context-parallel and, under sequence
    parallelism, tensor-parallel groups, whose ranks each fill their own part). None without routers."""
    import torch.distributed as dist

    reps = install(model_chunks)  # every stage, one without MoE layers too: it joins the sums below
    if not reps:
        return None
    b, t = batch.input_ids.shape
    out = torch.zeros((b, t, reps[0].num_layers, reps[0].topk), dtype=torch.int32, device=batch.input_ids.device)
    for mb, rows in zip(plan.micro_batches, plan.indices):
        offset = batch.prompt_len - mb.prompt_len  # micro-batches are cropped to their own padding
        for rep in reps:
            sources, per_router = rep._records.get(id(mb), (None, []))
            for r, idx in zip(rep.routers, per_router):
                keep = (sources >= 0) & (sources // mb.seq_len < len(rows))  # not appended padding rows
                src = sources[keep].to(out.device)
                row, col = rows.to(out.device)[src // mb.seq_len], src % mb.seq_len + offset
                out[row, col, r.layer] = idx.to(out.device)[keep.to(idx.device)].to(torch.int32)
    from megatron.core import parallel_state as mpu

    # each holds its own part: a pipeline stage its layers, a CP rank its chunks, a TP rank under sequence
    # parallelism its share of the tokens
    groups = [pp_group, mpu.get_context_parallel_group()]
    if reps[0].sequence_parallel:
        groups.append(mpu.get_tensor_model_parallel_group())
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(out, group=group)
    return out.to(routes_dtype(int(_config(model_chunks).num_moe_experts)))


def keep_recorded(model_chunks: Sequence[nn.Module], plan: Any, batch: Any, pp_group: Any) -> None:
    """After a forward-only pass: with recording on, the pass's routes (`recorded_routes`) for `take_recorded`."""
    reps = [replayer_of(c) for c in model_chunks]
    if reps and reps[0] is not None and reps[0].recording:
        reps[0].recorded = recorded_routes(model_chunks, plan, batch, pp_group)
        for rep in reps:
            rep._records = {}


def take_recorded(model_chunks: Sequence[nn.Module]) -> Optional[torch.Tensor]:
    """The routes [B, T, L, k] the last recorded pass chose (`set_recording`), recording off again."""
    reps = install(model_chunks)
    out = getattr(reps[0], "recorded", None) if reps else None
    for rep in reps:
        rep.recording, rep.recorded, rep._records = False, None, {}
    return out


def _config(model_chunks: Sequence[nn.Module]) -> Any:
    from megappo.models.builder import unwrap

    return unwrap(model_chunks[0]).config


def agreement(model_chunks: Sequence[nn.Module]) -> tuple[int, int]:
    """(routes where the routers' own top-k equals the replayed one, valid routes replayed) since the last reset, of
    this rank's share: summed over every rank, each route counts once (tensor-parallel peers route the same tokens,
    so only TP rank 0 reports, unless sequence parallelism gives each its own share)."""
    from megatron.core import parallel_state as mpu

    reps = install(model_chunks)
    if not reps or (mpu.get_tensor_model_parallel_rank() != 0 and not reps[0].sequence_parallel):
        return 0, 0
    return (sum(r.state.agree for rep in reps for r in rep.routers),
            sum(r.state.total for rep in reps for r in rep.routers))


def reset_agreement(model_chunks: Sequence[nn.Module]) -> None:
    for rep in install(model_chunks):
        for r in rep.routers:
            r.state.agree = r.state.total = 0


def batch_routes(routes: Sequence[Optional[torch.Tensor]], batch: Any) -> Optional[torch.Tensor]:
    """Per-sample routes (each [n_i, L, k] over the sample's prompt and response tokens from its first, the
    engine's `Completion.routed_experts`; None: none) -> the batch's [B, T, L, k], placed like the tokens (prompts
    left-padded); zeros where a sample has none. None when no sample has routes."""
    first = next((r for r in routes if r is not None and r.numel()), None)
    if first is None:
        return None
    b, t = batch.input_ids.shape
    out = torch.zeros((b, t, first.shape[1], first.shape[2]), dtype=first.dtype)
    starts = (batch.prompt_len - batch.prompt_lengths()).tolist()
    for i, r in enumerate(routes):
        if r is not None and r.numel():
            n = min(r.shape[0], t - starts[i])
            out[i, starts[i]:starts[i] + n] = r[:n].to(first.dtype)
    return out


def routes_to_json(routes: Optional[torch.Tensor]) -> Optional[dict]:
    """A sample's routes as JSON (a checkpoint's samples): their raw bytes in base64, 4/3 of L * k bytes a token."""
    import base64

    if routes is None or isinstance(routes, dict):
        return routes
    r = routes.contiguous()
    return {"shape": list(r.shape), "dtype": str(r.dtype).removeprefix("torch."),
            "b64": base64.b64encode(r.numpy().tobytes()).decode("ascii")}


def routes_from_json(routes: Any) -> Optional[torch.Tensor]:
    import base64

    if routes is None or isinstance(routes, torch.Tensor):
        return routes
    raw = bytearray(base64.b64decode(routes["b64"]))
    dtype = getattr(torch, routes["dtype"])
    return torch.frombuffer(raw, dtype=dtype).reshape(routes["shape"]) if raw else \
        torch.zeros(routes["shape"], dtype=dtype)
