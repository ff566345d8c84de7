"""SGLang's routed experts (`return_routed_experts`, SGLang 0.5.23; the server runs with
--enable-return-routed-experts): each answer's `meta_info.routed_experts` is base64 of an int32 array
[prompt + output - 1 tokens, num_hidden_layers, top_k] (sglang/srt/state_capturer/routed_experts.py, the
detokenizer's `_b64_encode_per_request`), every decoder layer's row whether or not it is a MoE layer. Decoded here
to megappo's routes: the MoE layers only, in the smallest dtype (`Completion.routed_experts`)."""
from __future__ import annotations

import base64

import torch

from megappo.rollout.routes import RouteLayout, engine_routes

__all__ = ["RouteLayout", "decode_routed_experts"]


def decode_routed_experts(b64: str, layout: RouteLayout) -> torch.Tensor:
    """meta_info.routed_experts -> [tokens, MoE layers, k] (uint8 up to 256 experts, else int16)."""
    raw = bytearray(base64.b64decode(b64))
    flat = torch.frombuffer(raw, dtype=torch.int32) if raw else torch.zeros(0, dtype=torch.int32)
    return engine_routes(flat, layout, "SGLang")
