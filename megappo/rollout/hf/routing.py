"""The in-process engine's record of each token's routed experts (MoE router replay, R3).

A forward hook on every MoE block's `gate` (transformers' Qwen2-MoE / Qwen3-MoE / Mixtral top-k routers, whose
forward returns (logits, scores, indices [b * s, k])) keeps the indices the engine actually used; after each forward
the engine names the forward's rows and their real input positions, and each row's routes grow by those tokens.
A row's routes then cover every token the engine fed: its prompt and its response but the last token,
[P + R - 1, L, k] (L: the model's MoE layers in order), which is what `ModelBatch.routes` replays in the trainer.

The hooks store nothing unless a generation asked (`begin`), so a request without `return_routed_experts` and a
dense model (no gates, `RouteRecorder.of` gives None) pay nothing.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

__all__ = ["RouteRecorder", "moe_gates"]


def moe_gates(model: nn.Module) -> list[nn.Module]:
    """The MoE routers of a transformers model, in layer order: the `gate` of each block that has experts."""
    return [m.gate for m in model.modules() if hasattr(m, "experts") and isinstance(getattr(m, "gate", None),
                                                                                   nn.Module)]


class RouteRecorder:
    """Per-row routes of one generation: `begin(n_rows)`, `after_forward(rows, new_mask)` after each forward,
    `routes(row)` at the end."""

    def __init__(self, gates: list[nn.Module], num_experts: int, topk: int):
        from megappo.models.router_replay import routes_dtype

        self.dtype, self.topk = routes_dtype(num_experts), topk
        self._pending: list[torch.Tensor] = []
        self._n = 0
        self._rows: Optional[list[torch.Tensor]] = None
        self._routes: list[torch.Tensor] = []
        self._split: Optional[list[torch.Tensor]] = None
        self.num_layers = len(gates)
        for g in gates:
            g.register_forward_hook(self._hook)

    @classmethod
    def of(cls, model: nn.Module) -> Optional["RouteRecorder"]:
        """The recorder of `model`'s MoE gates; None for a dense model."""
        gates = moe_gates(model)
        if not gates:
            return None
        cfg = getattr(model.config, "text_config", None) or model.config
        experts = int(getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", 0))
        return cls(gates, experts, int(cfg.num_experts_per_tok))

    def _hook(self, module: nn.Module, args: tuple, output) -> None:
        if self._rows is not None:
            self._pending.append(output[2].detach())

    def begin(self, n_rows: int) -> None:
        self._n, self._pending = n_rows, []
        self._rows, self._routes = [], []  # per forward: each real token's row [n_f], its routes [n_f, L, k]
        self._split: Optional[list[torch.Tensor]] = None

    def recording(self, forward: Callable, n_rows: int) -> Callable:
        """`forward(rows, new_mask, **kw)` (the engine's every forward of a generation) that records as it runs;
        a new record of `n_rows` rows begins."""
        self.begin(n_rows)

        def recorded(rows: torch.Tensor, new_mask: torch.Tensor, **kw):
            out = forward(rows, new_mask, **kw)
            self.after_forward(rows, new_mask)
            return out
        return recorded

    def after_forward(self, rows: torch.Tensor, new_mask: torch.Tensor) -> None:
        """rows [b] long: the generation's rows this forward ran; new_mask [b, s]: its real input positions. Each
        real position's routes [L, k] join its row, in position order (a few tensor operations a forward, whatever
        the batch: rows are only split apart at the end)."""
        if self._rows is None:
            return
        b, s = new_mask.shape
        if len(self._pending) != self.num_layers:
            raise RuntimeError(f"router replay: {len(self._pending)} MoE gates ran in a forward of a model with "
                               f"{self.num_layers}; record one forward at a time")
        routed = torch.stack([x.view(b, s, -1) for x in self._pending], 2).to(self.dtype)  # [b, s, L, k]
        self._pending = []
        keep = new_mask.bool().to(routed.device)
        self._rows.append(rows.to(routed.device).unsqueeze(1).expand(b, s)[keep])
        self._routes.append(routed[keep])

    def routes(self, row: int) -> torch.Tensor:
        """[n_tokens, L, k] the routes of every token fed for `row`, in order."""
        if self._split is None:
            self._split = self._by_row()
        return self._split[row]

    def _by_row(self) -> list[torch.Tensor]:
        if not self._rows:
            return [torch.zeros((0, self.num_layers, self.topk), dtype=self.dtype)] * (self._n or 0)
        rows, routes = torch.cat(self._rows), torch.cat(self._routes)
        order = torch.sort(rows, stable=True).indices  # stable: each row's tokens stay in the order they were fed
        counts = torch.bincount(rows, minlength=self._n).tolist()
        return [r.cpu() for r in routes[order].split(counts)]

    def end(self) -> None:
        self._rows, self._routes, self._pending, self._split = None, [], [], None
