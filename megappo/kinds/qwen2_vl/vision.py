"""Qwen2.5-VL's (and Qwen2-VL's) vision transformer built from megatron-core layers.

Pieces and where they come from:
- patch embedding: a bias-free Conv3d over (temporal_patch, patch, patch) pixels, replicated on every TP rank (the
  same weight shape as HF, so conversion is a copy).
- blocks: megatron-core `TransformerLayer`s (the ViT local spec: `SelfAttention` with `ColumnParallelLinear` qkv
  and `RowParallelLinear` proj, megatron's gated `MLP`), with megappo's `SDPAttention` as the core attention. They
  are TP-aware: heads and the MLP's hidden units are split over tensor-parallel ranks.
- 2-D rotary (megatron has none for vision): head_dim/4 frequencies per axis; the angles [h-freqs, w-freqs] are
  doubled to head_dim and applied by megatron's (non-interleaved) `apply_rotary_pos_emb` inside `SelfAttention`.
- window attention (megatron has none): the patches are put in window order and the blocks run megatron's packed
  THD format (`PackedSeqParams` with `cu_seqlens` at the window boundaries, `attn_mask_type=no_mask`), so each
  window attends to itself only and attention costs sum(L_i^2), never N^2 (no N x N mask); megappo's `SDPAttention`
  runs windows of equal length as one batched call. Layers in `fullatt_block_indexes` get the per-image boundaries
  instead. Qwen2-VL has no windows: every layer per image. The rotary angles are given per patch for the whole pack
  ([N, 1, 1, head_dim]), which megatron's THD rotary applies by absolute offset, exactly as without packing (its
  unfused THD rotary reads each segment's offset from cu_seqlens with `.item()`: on GPU one sync per window per
  layer; TE's fused THD rotary would restart positions per segment, so `apply_rope_fusion` stays off).
- patch merger: RMSNorm, 2x2 neighbouring patches concatenated, then megatron's `MultimodalProjector` (an MLP with
  ColumnParallel fc1, GELU, RowParallel fc2) to the LM hidden size.

Parameter names (this rank's TP shard; qkv rows are per head [q, k, v] like megatron's linear_qkv with one query
per group): patch_embed.proj.weight [C, 3, tp, p, p]; blocks.N.input_layernorm.weight,
blocks.N.self_attention.linear_qkv.{weight [3C/tp, C], bias}, blocks.N.self_attention.linear_proj.{weight, bias},
blocks.N.pre_mlp_layernorm.weight, blocks.N.mlp.linear_fc1.{weight [2F/tp, C] as [gate; up], bias},
blocks.N.mlp.linear_fc2.{weight, bias}; merger.ln_q.weight, merger.projection.encoder.linear_fc{1,2}.{weight, bias}.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class VisionArgs:
    """The vision tower's shape, read from the HF `vision_config`."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int = 3
    window_size: int = 0  # 0: no window attention (Qwen2-VL)
    fullatt_block_indexes: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    gated_mlp: bool = True  # Qwen2.5-VL: SwiGLU with biases; Qwen2-VL: fc1 -> quick_gelu -> fc2
    norm: str = "RMSNorm"  # Qwen2-VL uses LayerNorm
    eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def vision_args_from_hf(vcfg: dict[str, Any], family: str) -> VisionArgs:
    """VisionArgs from a HF `vision_config` dict (transformers 4 or 5 spelling) of a `family` model."""
    return _VISION_READERS.get(family, _qwen2_5_vl_vision)(vcfg)


def _qwen2_vl_vision(vcfg: dict[str, Any]) -> VisionArgs:
    from megappo.models.hf_config import UnsupportedModelError

    if vcfg.get("hidden_act", "quick_gelu") != "quick_gelu":
        raise UnsupportedModelError(f"Qwen2-VL vision hidden_act {vcfg['hidden_act']!r}: only quick_gelu")
    return VisionArgs(
        depth=int(vcfg["depth"]), hidden_size=int(vcfg["embed_dim"]), num_heads=int(vcfg["num_heads"]),
        intermediate_size=int(vcfg["embed_dim"] * vcfg.get("mlp_ratio", 4)),
        out_hidden_size=int(vcfg["hidden_size"]), patch_size=int(vcfg["patch_size"]),
        temporal_patch_size=int(vcfg["temporal_patch_size"]), spatial_merge_size=int(vcfg["spatial_merge_size"]),
        in_channels=int(vcfg.get("in_channels", vcfg.get("in_chans", 3))), gated_mlp=False, norm="LayerNorm",
    )


def _qwen2_5_vl_vision(vcfg: dict[str, Any]) -> VisionArgs:
    from megappo.models.hf_config import UnsupportedModelError

    rope = vcfg.get("rope_parameters") or {}
    if vcfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"Qwen2.5-VL vision hidden_act {vcfg['hidden_act']!r}: only silu is supported")
    return VisionArgs(
        depth=int(vcfg["depth"]), hidden_size=int(vcfg["hidden_size"]), num_heads=int(vcfg["num_heads"]),
        intermediate_size=int(vcfg["intermediate_size"]), out_hidden_size=int(vcfg["out_hidden_size"]),
        patch_size=int(vcfg["patch_size"]), temporal_patch_size=int(vcfg["temporal_patch_size"]),
        spatial_merge_size=int(vcfg["spatial_merge_size"]),
        in_channels=int(vcfg.get("in_channels", vcfg.get("in_chans", 3))),  # transformers 4: in_chans
        window_size=int(vcfg.get("window_size", 0) or 0),
        fullatt_block_indexes=tuple(int(i) for i in vcfg.get("fullatt_block_indexes") or ()),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
    )


# model_type -> its vision tower's config reader (Qwen2-VL: LayerNorm, quick_gelu, plain MLP; Qwen2.5-VL: the rest)
_VISION_READERS = {"qwen2_vl": _qwen2_vl_vision, "qwen2_5_vl": _qwen2_5_vl_vision}


def _vision_transformer_config(args: VisionArgs, tp: int, dtype: torch.dtype, use_cpu_init: bool):
    """The megatron TransformerConfig of the vision blocks: no pipeline (the tower lives on the first stage)."""
    from megatron.core.transformer import TransformerConfig

    def quick_gelu(x):  # Qwen2-VL's vision MLP activation
        return x * torch.sigmoid(1.702 * x)

    return TransformerConfig(
        num_layers=args.depth, hidden_size=args.hidden_size, ffn_hidden_size=args.intermediate_size,
        num_attention_heads=args.num_heads, num_query_groups=args.num_heads, kv_channels=args.head_dim,
        normalization=args.norm, layernorm_epsilon=args.eps, gated_linear_unit=args.gated_mlp,
        activation_func=F.silu if args.gated_mlp else quick_gelu, add_bias_linear=True, add_qkv_bias=True,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=use_cpu_init,
    )


def _projector_config(args: VisionArgs, tp: int, dtype: torch.dtype, use_cpu_init: bool):
    """The merger MLP: [4C] -> 4C (GELU) -> LM hidden, as megatron's MultimodalProjector reads it from a config."""
    from megatron.core.transformer import TransformerConfig

    merged = args.hidden_size * args.spatial_merge_size ** 2
    return TransformerConfig(
        num_layers=1, hidden_size=args.out_hidden_size, ffn_hidden_size=merged, num_attention_heads=tp,  # unused
        activation_func=F.gelu, gated_linear_unit=False, add_bias_linear=True, bias_activation_fusion=False,
        gradient_accumulation_fusion=False, tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=use_cpu_init,
    )


def _layer_spec():
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from megappo.models.attention import SDPAttention

    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=WrappedTorchNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                # bidirectional within each packed segment (a window or an image, see VisionModel.forward)
                params={"attn_mask_type": AttnMaskType.no_mask},
                submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear, core_attention=SDPAttention,
                                                   linear_proj=RowParallelLinear),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=WrappedTorchNorm,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                linear_fc2=RowParallelLinear)),
            mlp_bda=get_bias_dropout_add,
        ),
    )


# -- index arithmetic (pure torch, shapes from grid_thw [num_images, 3] = (t, h, w) in patches) -------------------

def vision_rotary_positions(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """(h, w) patch coordinates [N, 2] in the tower's patch order (merge x merge blocks are contiguous)."""
    out = []
    for t, h, w in grid_thw.tolist():
        hpos = torch.arange(h).unsqueeze(1).expand(-1, w)
        wpos = torch.arange(w).unsqueeze(0).expand(h, -1)
        shape = (h // merge, merge, w // merge, merge)
        hpos = hpos.reshape(shape).permute(0, 2, 1, 3).flatten()
        wpos = wpos.reshape(shape).permute(0, 2, 1, 3).flatten()
        out.append(torch.stack([hpos, wpos], dim=-1).repeat(t, 1))
    return torch.cat(out)


def window_index(grid_thw: torch.Tensor, args: VisionArgs) -> tuple[torch.Tensor, list[int]]:
    """(order of merged tokens grouped by window [N / merge^2], window lengths in patches), as Qwen2.5-VL tiles."""
    merge = args.spatial_merge_size
    win = args.window_size // merge // args.patch_size
    index, lengths, offset = [], [], 0
    for t, h, w in grid_thw.tolist():
        gh, gw = h // merge, w // merge
        idx = torch.arange(t * gh * gw).reshape(t, gh, gw)
        ph, pw = win - gh % win, win - gw % win
        nh, nw = (gh + ph) // win, (gw + pw) // win
        padded = F.pad(idx, (0, pw, 0, ph), value=-100).reshape(t, nh, win, nw, win).permute(0, 1, 3, 2, 4)
        padded = padded.reshape(t, nh * nw, win * win)
        counts = (padded != -100).sum(-1).flatten()
        flat = padded.flatten()
        index.append(flat[flat != -100] + offset)
        lengths += [int(c) * merge * merge for c in counts if c > 0]
        offset += t * gh * gw
    return torch.cat(index), lengths


def segment_params(lengths: list[int], device: torch.device):
    """megatron's packed (THD) params for segments of `lengths` consecutive patches: each attends to itself only."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                           max_seqlen_kv=max(lengths))


def _sharded_state_dict(module: nn.Module, prefix: str, sharded_offsets: tuple, metadata) -> dict:
    """megatron's sharded state dict of `module`, descending through plain containers (ModuleList, nn.Module).

    megatron's default treats a child without `sharded_state_dict` as replicated: the TP-split linears inside a
    ModuleList of blocks would then be saved as one rank's shard under the full tensor's name."""
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.utils import sharded_state_dict_default

    # a replicated tensor's replica id must name its TP rank (only TP rank 0 saves it); megatron leaves that to
    # the caller once metadata brings a data-parallel group
    tp = mpu.get_tensor_model_parallel_group()
    if hasattr(module, "sharded_state_dict") or not any(True for _ in module.children()):
        return sharded_state_dict_default(module, prefix, sharded_offsets, metadata, tp_group=tp)
    out = sharded_state_dict_default(_OwnTensors(module), prefix, sharded_offsets, metadata, tp_group=tp)
    for name, child in module.named_children():
        out.update(_sharded_state_dict(child, f"{prefix}{name}.", sharded_offsets, metadata))
    return out


class _OwnTensors(nn.Module):
    """A view of a container's own parameters and buffers only (its children are handled one by one)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self._own = module

    def state_dict(self, *args, prefix: str = "", keep_vars: bool = False, **kw):
        own = {**dict(self._own.named_parameters(recurse=False)),
               **{n: b for n, b in self._own.named_buffers(recurse=False)
                  if n not in self._own._non_persistent_buffers_set}}
        return {prefix + n: (t if keep_vars else t.detach()) for n, t in own.items()}


class VisionModel(nn.Module):
    """The vision tower: pixel patches [N, C_in * tp * p * p] + grid_thw -> merged image embeddings [N / m^2, H_lm]."""

    def __init__(self, args: VisionArgs, tp: int, dtype: torch.dtype, use_cpu_init: bool = True):
        super().__init__()
        from megatron.core.models.vision.multimodal_projector import MultimodalProjector
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.mlp import MLPSubmodules
        from megatron.core.transformer.spec_utils import build_module

        self.args = args
        self.config = _vision_transformer_config(args, tp, dtype, use_cpu_init)
        k = (args.temporal_patch_size, args.patch_size, args.patch_size)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(args.in_channels, args.hidden_size, kernel_size=k, stride=k, bias=False,
                                          dtype=dtype)
        spec = _layer_spec()
        self.blocks = nn.ModuleList([build_module(spec, config=self.config, layer_number=i + 1)
                                     for i in range(args.depth)])
        merged = args.hidden_size * args.spatial_merge_size ** 2
        self.merger = nn.Module()
        norm = nn.RMSNorm if args.norm == "RMSNorm" else nn.LayerNorm
        self.merger.ln_q = norm(args.hidden_size, eps=args.eps, dtype=dtype)
        self.merger.projection = MultimodalProjector(
            _projector_config(args, tp, dtype, use_cpu_init),
            MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear), "mlp", merged)
        for module in self.modules():  # megatron's torch norms ignore params_dtype
            if isinstance(module, (nn.RMSNorm, nn.LayerNorm)):
                module.to(dtype)
        spatial = args.head_dim // 2
        inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        """For megatron's dist_checkpointing: TP-split tensors saved under their full (TP-1) shapes."""
        out = {}
        for name, child in self.named_children():
            out.update(_sharded_state_dict(child, f"{prefix}{name}.", sharded_offsets, metadata))
        return out

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C_in * tp * p * p] (the HF processor's flattening), grid_thw [I, 3] -> [N / m^2, H_lm]."""
        a = self.args
        unit = a.spatial_merge_size ** 2
        w = self.patch_embed.proj.weight
        x = pixel_values.to(w.dtype).view(-1, a.in_channels, a.temporal_patch_size, a.patch_size, a.patch_size)
        x = self.patch_embed.proj(x).view(-1, a.hidden_size)  # [N, C]
        n = x.shape[0]
        pos = vision_rotary_positions(grid_thw, a.spatial_merge_size).to(x.device)
        freqs = (pos[..., None].float() * self.inv_freq.to(x.device)).flatten(1)  # [N, head_dim / 2]: h then w
        image_lengths = (grid_thw[:, 0] * grid_thw[:, 1] * grid_thw[:, 2]).tolist()
        if a.window_size:
            order, win_lengths = window_index(grid_thw, a)
            order = order.to(x.device)
            # reorder whole merge units so that each window's patches are contiguous
            x = x.view(n // unit, unit, -1)[order].reshape(n, -1)
            freqs = freqs.view(n // unit, unit, -1)[order].reshape(n, -1)
            windows = segment_params(win_lengths, x.device)
        images = segment_params(image_lengths, x.device)  # window order keeps each image's patches together
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]  # [N, 1, 1, head_dim] as megatron's RoPE reads
        h = x.unsqueeze(1)  # [s, b=1, C]
        for i, block in enumerate(self.blocks):
            packed = images if not a.window_size or i in a.fullatt_block_indexes else windows
            h, _ = block(h, attention_mask=None, rotary_pos_emb=emb, packed_seq_params=packed)
        h = self.merger.ln_q(h.squeeze(1)).view(n // unit, -1)
        out = self.merger.projection(h)
        if isinstance(out, tuple):
            out = out[0]
        if a.window_size:
            out = out[torch.argsort(order)]
        return out
