"""SGLang's routed experts (`return_routed_experts`, SGLang 0.5.23; the server runs with
--enable-return-routed-experts): each answer's `meta_info.routed_experts` is base64 of an int32 array
[prompt + output - 1 tokens, num_hidden_layers, top_k] (sglang/srt/state_capturer/routed_experts.py, the
detokenizer's `_b64_encode_per_request`), every decoder layer's row whether or not it is a MoE layer. Decoded here
to megappo's routes: the MoE layers only, in the smallest dtype (`Completion.routed_experts`)."""
from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["RouteLayout", "decode_routed_experts"]


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


def decode_routed_experts(b64: str, layout: RouteLayout) -> torch.Tensor:
    """meta_info.routed_experts -> [tokens, MoE layers, k] (uint8 up to 256 experts, else int16)."""
    from megappo.models.router_replay import routes_dtype

    raw = bytearray(base64.b64decode(b64))
    n_layers = len(layout.moe_layers)
    flat = torch.frombuffer(raw, dtype=torch.int32) if raw else torch.zeros(0, dtype=torch.int32)
    if flat.numel() % (n_layers * layout.topk):
        raise ValueError(f"SGLang's routed_experts holds {flat.numel()} ids, not a multiple of {n_layers} layers x "
                         f"top-{layout.topk}: the server's model is not the one this client was given")
    routes = flat.view(-1, n_layers, layout.topk)
    routes = routes[:, torch.tensor(layout.moe_layers, dtype=torch.bool)]
    if routes.numel() and (int(routes.min()) < 0 or int(routes.max()) >= layout.num_experts):
        # a narrower dtype would wrap them into valid-looking experts, replayed silently
        raise ValueError(f"SGLang's routed_experts name experts {int(routes.min())}..{int(routes.max())} of a model "
                         f"with {layout.num_experts}: the server's model is not the one this client was given")
    return routes.to(routes_dtype(layout.num_experts))
