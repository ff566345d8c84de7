"""The vision tower's packed (THD) window / per-image attention equals the dense block-diagonal mask it replaced.

`VisionModel.forward` runs its blocks on megatron's packed format (one `cu_seqlens` segment per window, or per
image in full-attention blocks) through `SDPAttention`'s per-segment path, with segments of equal length batched.
The reference below is the former implementation: the same blocks called with a boolean [1, 1, N, N] mask (True =
blocked across segments) and no packed params. Images of different sizes give windows that do not tile the image
(partial windows at the right and bottom edges), so equal-length windows are not adjacent (the gather path) and the
full-attention blocks see images of different lengths. Outputs and parameter gradients agree to fp32 rounding, with
equal-length batching on and off.
"""
from __future__ import annotations

import pytest
import torch

from megappo.testing.dist import run_distributed

# (t, h, w) in patches: merged 2x3, 5x4, 3x5 and 8x6; with 2x2-merged-unit windows (window_size 56) that is
# windows of 4, 2 (partial) and 1 (a corner) merged units, equal lengths interleaved with others
GRIDS = [(1, 4, 6), (1, 10, 8), (1, 6, 10), (1, 16, 12)]


def _segment_mask(lengths: list[int]) -> torch.Tensor:
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return (seg[:, None] != seg[None, :])[None, None]


def _dense_reference(vision, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """The tower's forward with dense [1, 1, N, N] segment masks instead of packed params (the former code)."""
    from megappo.kinds.qwen2_vl.vision import vision_rotary_positions, window_index

    a = vision.args
    unit = a.spatial_merge_size ** 2
    x = pixel_values.view(-1, a.in_channels, a.temporal_patch_size, a.patch_size, a.patch_size)
    x = vision.patch_embed.proj(x).view(-1, a.hidden_size)
    n = x.shape[0]
    freqs = (vision_rotary_positions(grid_thw, a.spatial_merge_size)[..., None].float() * vision.inv_freq).flatten(1)
    full_mask = _segment_mask((grid_thw[:, 0] * grid_thw[:, 1] * grid_thw[:, 2]).tolist())
    if a.window_size:
        order, win_lengths = window_index(grid_thw, a)
        x = x.view(n // unit, unit, -1)[order].reshape(n, -1)
        freqs = freqs.view(n // unit, unit, -1)[order].reshape(n, -1)
        window_mask = _segment_mask(win_lengths)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]
    h = x.unsqueeze(1)
    for i, block in enumerate(vision.blocks):
        mask = full_mask if not a.window_size or i in a.fullatt_block_indexes else window_mask
        h, _ = block(h, attention_mask=mask, rotary_pos_emb=emb)
    out = vision.merger.projection(vision.merger.ln_q(h.squeeze(1)).view(n // unit, -1))
    out = out[0] if isinstance(out, tuple) else out
    return out[torch.argsort(order)] if a.window_size else out


def _job(rank, world_size):
    from megappo.parallel import destroy_parallel, init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout

    torch.set_num_threads(1)
    init_parallel(ParallelLayout(), detect_platform(), seed=0)
    results = {family: _compare(family) for family in ("qwen2_5_vl", "qwen2_vl")}
    destroy_parallel()
    return results


def _compare(family: str) -> dict:
    from megappo.models.attention import SDPAttention
    from megappo.kinds.qwen2_vl.vision import VisionModel, vision_args_from_hf, window_index
    from megappo.testing.vlm_models import tiny_vlm_config

    args = vision_args_from_hf(tiny_vlm_config(family).vision_config.to_dict(), family)
    torch.manual_seed(0)
    vision = VisionModel(args, tp=1, dtype=torch.float32)
    with torch.no_grad():  # megatron zero-initialises biases: random ones make the comparison meaningful
        for p in vision.parameters():
            p.normal_(0.0, 0.2)
    grid = torch.tensor(GRIDS)
    g = torch.Generator().manual_seed(1)
    pixels = torch.randn(int(grid.prod(-1).sum()), args.in_channels * args.temporal_patch_size * args.patch_size ** 2,
                         generator=g)
    results = {"window_lengths": window_index(grid, args)[1] if args.window_size else []}
    for name, run in (("dense", lambda: _dense_reference(vision, pixels, grid)),
                      ("packed", lambda: vision(pixels, grid)),
                      ("per_segment", lambda: vision(pixels, grid))):
        SDPAttention.group_equal_lengths = name != "per_segment"
        vision.zero_grad(set_to_none=True)
        out = run()
        out.pow(2).mean().backward()
        results[name] = (out.detach(), {n: p.grad.clone() for n, p in vision.named_parameters()})
    SDPAttention.group_equal_lengths = True
    return results


@pytest.fixture(scope="module")
def results():
    return run_distributed(_job, 1, timeout=300)[0]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
def test_packed_vision_attention_equals_dense_mask(results, family):
    res = results[family]
    if family == "qwen2_5_vl":  # the windows do not tile: equal lengths recur apart from each other
        lengths = res["window_lengths"]
        assert sorted(set(lengths)) == [4, 8, 16] and lengths[:3] == [16, 8, 16], lengths
    ref_out, ref_grads = res["dense"]
    assert ref_out.shape == (sum(t * h * w for t, h, w in GRIDS) // 4, 64)
    for name in ("packed", "per_segment"):
        out, grads = res[name]
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5, msg=name)
        assert grads.keys() == ref_grads.keys()
        for k in ref_grads:
            torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-4, atol=1e-5, msg=f"{name} {k}")
