"""The scalar value head of the critic and the reward model.

It replaces `GPTModel.output_layer` on the last pipeline stage, so its state-dict name is
`output_layer.weight`, shape [1, hidden_size] (replicated over TP ranks), and `GPTModel.forward` (no labels) returns
per-token values of shape [B, T]. A Hugging Face `*ForSequenceClassification` checkpoint's `score.weight`
(shape [num_labels=1, hidden_size], no bias) maps onto it one to one.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

VALUE_HEAD_STATE_DICT_KEY = "output_layer.weight"  # shape [1, hidden_size]


class ValueHead(nn.Module):
    """hidden [T, B, H] -> values [T, B] (GPTModel transposes to [B, T]).

    Called by GPTModel as `output_layer(hidden, weight=None, runtime_gather_output=...)` and must return a pair.
    `seed` makes the fresh initialisation identical on every rank (TP ranks hold replicas).
    """

    def __init__(self, hidden_size: int, *, std: float, dtype: torch.dtype, device: torch.device | str,
                 sequence_parallel: bool = False, tp_group: Any = None, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        # explicit CPU: under a meta-device build (streamed conversion) the fresh head still gets real values
        w = torch.randn(1, hidden_size, generator=gen, dtype=torch.float32, device="cpu") * std
        self.weight = nn.Parameter(w.to(device=device, dtype=dtype))
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group

    def forward(self, hidden: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None, **_: Any) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # Each TP rank then computes identical values; the backward splits (no reduce) accordingly.
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False,
                                                          group=self.tp_group)
        values = torch.matmul(hidden, self.weight.to(hidden.dtype).t()).squeeze(-1)  # [T, B]
        return values, None


def last_token_values(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """values [B, T], attention_mask [B, T] (1 = token) -> [B], the value at each row's last non-pad token.

    Works with left or right padding. A row with no token raises (it has no score).
    """
    if values.shape != attention_mask.shape:
        raise ValueError(f"values {tuple(values.shape)} and attention_mask {tuple(attention_mask.shape)} differ")
    mask = attention_mask.bool()
    if not bool(mask.any(dim=1).all()):
        empty = (~mask.any(dim=1)).nonzero().flatten().tolist()
        raise ValueError(f"rows {empty} of attention_mask have no tokens; drop empty sequences before scoring")
    positions = torch.arange(values.shape[1], device=values.device).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).amax(dim=1)  # [B]
    return values.gather(1, last.unsqueeze(1)).squeeze(1)
