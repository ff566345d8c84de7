"""Routed experts as engines return them, made megappo's routes (`Completion.routed_experts`: the MoE layers only,
in the smallest dtype). Every engine that returns routes (SGLang, vLLM) goes through `engine_routes`, so a server
serving another model than the trainer's is an error here, never a silently replayed wrong route."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["RouteLayout", "engine_routes"]


@dataclass(frozen=True)
class RouteLayout:
    """Which decoder layers of the served model are MoE layers, its top-k and its expert count."""

    moe_layers: tuple[bool, ...]
    topk: int
    num_experts: int

    @classmethod
    def of(cls, model_path: str) -> Optional["RouteLayout"]:
        """From a HF directory's config.json (Qwen2-MoE / Qwen3-MoE / Mixtral keys); None for a dense model."""
        with open(os.path.join(model_path, "config.json")) as f:
            cfg = json.load(f)
        cfg = cfg.get("text_config", cfg)
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        if not experts:
            return None
        n, step = int(cfg["num_hidden_layers"]), int(cfg.get("decoder_sparse_step") or 1)
        dense = set(cfg.get("mlp_only_layers") or [])
        return cls(tuple(i not in dense and (i + 1) % step == 0 for i in range(n)), int(cfg["num_experts_per_tok"]),
                   experts)


def engine_routes(ids: torch.Tensor, layout: RouteLayout, engine: str) -> torch.Tensor:
    """An engine's routes, flat or [tokens, layers, k] over every decoder layer or over the MoE layers only ->
    [tokens, MoE layers, k] (uint8 up to 256 experts, else int16). Raises ValueError naming `engine` when the shape
    or the expert ids do not fit the layout (the engine serves another model)."""
    from megappo.models.router_replay import routes_dtype

    moe = torch.tensor(layout.moe_layers, dtype=torch.bool)
    n_all, n_moe = len(layout.moe_layers), int(moe.sum())
    flat = ids.reshape(-1).to(torch.int64)
    if ids.dim() == 3 and ids.shape[1] in (n_all, n_moe) and ids.shape[2] == layout.topk:
        layers = ids.shape[1]
    elif flat.numel() % (n_all * layout.topk) == 0:
        layers = n_all
    else:
        raise ValueError(f"{engine}'s routed experts hold {tuple(ids.shape)} ids, not [tokens, {n_all} layers, "
                         f"top-{layout.topk}]: the server's model is not the one this client was given")
    routes = flat.view(-1, layers, layout.topk)
    if layers == n_all and n_all != n_moe:
        routes = routes[:, moe]
    if routes.numel() and (int(routes.min()) < 0 or int(routes.max()) >= layout.num_experts):
        # a narrower dtype would wrap them into valid-looking experts, replayed silently
        raise ValueError(f"{engine}'s routed experts name experts {int(routes.min())}..{int(routes.max())} of a model "
                         f"with {layout.num_experts}: the server's model is not the one this client was given")
    return routes.to(routes_dtype(layout.num_experts))
