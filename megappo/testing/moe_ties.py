"""Tiny MoE models whose routers are close to ties, and the engine-vs-trainer log-prob check of router replay.

`make_tied_moe(family, out_dir)` writes a tiny Qwen2-MoE / Qwen3-MoE whose router rows 0..k are copies of one row
plus `noise` (relative): the choice among them is decided by differences near float32 rounding, so two
implementations of the same forward (transformers in the engine, megatron in the trainer) route some tokens to
different experts, as large MoE policies do between an inference engine and a trainer.

`engine_vs_trainer(...)` (run on gloo ranks: `megappo.testing.dist.run_distributed`) samples with the in-process
engine, recording routes, and scores the samples with megatron with and without replaying them.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from megappo.testing.hf_models import make_hf_model

__all__ = ["make_tied_moe", "engine_samples", "engine_vs_trainer", "tie_prompts", "route_differences"]


def make_tied_moe(family: str, out_dir: str, *, noise: float = 1e-6, seed: int = 0) -> str:
    """A tiny `family` MoE (4 experts, top-2) whose gates' first k + 1 rows are near-identical (see the module)."""
    from safetensors.torch import load_file, save_file

    path = make_hf_model(family, out_dir, seed=seed)
    weights = os.path.join(path, "model.safetensors")
    state = load_file(weights)
    g = torch.Generator().manual_seed(seed + 1)
    for name, w in state.items():
        if name.endswith("mlp.gate.weight"):  # [E, H]
            tied = w[0].clone()
            for e in range(3):
                w[e] = tied * (1 + noise * torch.randn(tied.shape, generator=g))
            state[name] = w.contiguous()
    save_file(state, weights, metadata={"format": "pt"})
    return path


def engine_samples(hf_dir: str, prompts: list[list[int]], max_new_tokens: int = 12, seed: int = 5):
    """Sampled completions with the engine's routes: (prompts, responses, engine log-probs, routes per sample)."""
    from megappo.rollout import HFEngine, SamplingParams

    engine = HFEngine(hf_dir)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=seed, ignore_eos=True,
                            return_routed_experts=True)
    done = [c for group in engine.generate(prompts, params) for c in group]
    return [c.output_ids for c in done], [c.log_probs for c in done], [c.routed_experts for c in done]


def engine_vs_trainer(rank: int, world_size: int, hf_dir: str, prompts: list[list[int]], layout_kw: dict,
                      micro_kw: dict) -> dict[str, Any]:
    """On every rank: the engine's samples (rank 0's, broadcast), the trainer's log-probs of them replaying the
    engine's routes (R3) and not, the trainer's own routes (recorded) and its log-probs replaying those (R2).
    Tensors are this rank's data-parallel share's."""
    from megappo.kinds.build import build_model
    from megappo.kinds.weights import load_hf_weights
    from megappo.models import router_replay
    from megappo.models.batch import ModelBatch
    from megappo.models.compute import MicroBatching, compute_log_probs
    from megappo.models.router_replay import batch_routes
    from megappo.parallel import destroy_parallel, init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout

    responses, engine_lp, routes = _shared_engine_samples(rank, world_size, hf_dir, prompts)
    plat = detect_platform()
    ps = init_parallel(ParallelLayout(**layout_kw), plat, seed=0)
    chunks = build_model(hf_dir, "actor", ps, plat, seed=0)
    load_hf_weights(chunks, hf_dir, ps)
    router_replay.install(chunks)
    batch = ModelBatch.from_token_lists(prompts, responses, pad_token_id=0)
    micro = MicroBatching(**micro_kw)
    rows = torch.arange(batch.batch_size).chunk(ps.dp_size)[ps.dp_rank]
    router_replay.set_recording(chunks, True)
    free, _ = compute_log_probs(chunks, batch.select(rows), parallel_state=ps, micro=micro)
    own = router_replay.take_recorded(chunks)  # [b, T, L, k] of this rank's rows
    mine = batch.select(rows)
    mine.routes = own
    r2, _ = compute_log_probs(chunks, mine, parallel_state=ps, micro=micro)  # R2: the recorded routes replayed
    batch.routes = batch_routes(routes, batch)
    router_replay.reset_agreement(chunks)
    replayed, _ = compute_log_probs(chunks, batch.select(rows), parallel_state=ps, micro=micro)
    agree, total = router_replay.agreement(chunks)  # this rank's share (0, 0 on a TP peer without SP)
    lp = torch.zeros(batch.response_mask.shape)
    for i, x in enumerate(engine_lp):
        lp[i, :len(x)] = torch.tensor(x)
    destroy_parallel()
    return {"rows": rows, "engine": lp[rows], "free": free, "replayed": replayed, "own": own, "r2": r2,
            "engine_routes": batch.routes[rows], "mask": batch.response_mask[rows], "agree": agree, "total": total,
            "attention_mask": batch.attention_mask[rows]}


def _shared_engine_samples(rank: int, world_size: int, hf_dir: str, prompts: list[list[int]]) -> tuple:
    """`engine_samples` of rank 0, broadcast to every rank (one engine generates what every rank replays)."""
    import torch.distributed as dist

    payload = [engine_samples(hf_dir, prompts) if rank == 0 else None]
    if world_size > 1:
        dist.broadcast_object_list(payload, src=0)
    return payload[0]


def tie_prompts() -> list[list[int]]:
    """Four prompts of 3-9 tokens."""
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, 400, (n,), generator=g).tolist() for n in (5, 9, 3, 7)]


def route_differences(out: dict[str, Any]) -> tuple[int, int, int]:
    """(routes, tokens, valid routes): where the trainer's own routing (`out["own"]`) differs from the engine's
    (`out["engine_routes"]`), over the engine's valid routes."""
    from megappo.models.router_replay import distinct

    eng, own = out["engine_routes"].long(), out["own"].long()
    valid = distinct(eng)
    diff = (own.sort(-1).values != eng.sort(-1).values).any(-1) & valid
    return int(diff.sum()), int(diff.any(-1).sum()), int(valid.sum())


def _nll(out, ctx):
    m = ctx.batch.response_mask.float()
    return -(out.log_probs * m).sum() / ctx.global_num_tokens, {}


def replay_grads(rank: int, world_size: int, hf_dir: str, prompts: list[list[int]], layout_kw: dict,
                 micro_kw: dict) -> list[dict[str, torch.Tensor]]:
    """Rank 0's gradients (HF names, merged over TP / PP) of the engine samples' NLL under replayed routes, built
    without and with activation recompute (full, one layer at a time): they must be the same."""
    import torch.distributed as dist

    from megappo.kinds.build import build_model
    from megappo.kinds.weights import hf_state_dict, load_hf_weights
    from megappo.models import router_replay
    from megappo.models.batch import ModelBatch
    from megappo.models.compute import MicroBatching, train_step
    from megappo.models.hf_config import load_hf_config_dict
    from megappo.models.optim import OptimSettings, build_optimizer, wrap_ddp
    from megappo.models.router_replay import batch_routes
    from megappo.parallel import destroy_parallel, init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout

    responses, _, routes = _shared_engine_samples(rank, world_size, hf_dir, prompts)
    plat = detect_platform()
    ps = init_parallel(ParallelLayout(**layout_kw), plat, seed=0)
    batch = ModelBatch.from_token_lists(prompts, responses, pad_token_id=0)
    batch.routes = batch_routes(routes, batch)
    rows = torch.arange(batch.batch_size).chunk(ps.dp_size)[ps.dp_rank]
    out = []
    for tc in ({}, {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}):
        chunks = build_model(hf_dir, "actor", ps, plat, seed=0, config_overrides=tc)
        load_hf_weights(chunks, hf_dir, ps)
        router_replay.install(chunks)
        settings = OptimSettings(lr=0.0, clip_grad=0.0, total_steps=1)
        ddp = wrap_ddp(chunks, settings, plat)
        train_step(ddp, build_optimizer(ddp, settings, plat), None, batch.select(rows), _nll, parallel_state=ps,
                   micro=MicroBatching(**micro_kw), platform=plat)
        params = [p for c in ddp for p in c.parameters()]
        saved = [p.data for p in params]
        for p in params:
            p.data = p.main_grad.view_as(p)
        grads = hf_state_dict(ddp, ps, load_hf_config_dict(hf_dir))
        for p, d in zip(params, saved):
            p.data = d
        out.append(grads if dist.get_rank() == 0 else {})
    destroy_parallel()
    return out
