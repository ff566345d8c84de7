"""The value head's shapes and the reward read-out at the last non-pad token (left and right padding)."""
from __future__ import annotations

import pytest
import torch

from megappo.models.value_head import VALUE_HEAD_STATE_DICT_KEY, ValueHead, last_token_values


def test_value_head_shapes_and_seeded_init():
    a = ValueHead(8, std=0.02, dtype=torch.float32, device="cpu", seed=3)
    b = ValueHead(8, std=0.02, dtype=torch.float32, device="cpu", seed=3)
    assert torch.equal(a.weight, b.weight) and a.weight.shape == (1, 8)  # identical on every TP rank
    values, bias = a(torch.randn(5, 2, 8))  # [T, B, H]
    assert values.shape == (5, 2) and bias is None
    assert VALUE_HEAD_STATE_DICT_KEY == "output_layer.weight"


def test_last_token_values_left_and_right_padding():
    values = torch.arange(12.0).view(2, 6)
    right = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    left = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0]])
    assert last_token_values(values, right).tolist() == [2.0, 11.0]
    assert last_token_values(values, left).tolist() == [5.0, 10.0]
    with pytest.raises(ValueError, match="rows \\[1\\] of attention_mask have no tokens"):
        last_token_values(values, torch.tensor([[1, 0, 0, 0, 0, 0], [0] * 6]))
    with pytest.raises(ValueError, match="differ"):
        last_token_values(values, right[:, :3])
