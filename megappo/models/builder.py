"""Build the trainer's megatron-core models of the text families: actor, reference, critic and reward model.

`build_gpt_model(...)` (which `megappo.kinds.build.build_model` calls for a text model) returns one GPTModel per
virtual pipeline stage held by this rank (a list of length 1 without VPP). Chunks are not wrapped in DDP: the
training-step code does that. Parameters live on `platform.device` in `platform.dtype`.

Roles:
- actor:  trainable, LM head; forward(input_ids, position_ids, attention_mask) on the last stage returns
          vocab-parallel logits [B, T, padded_vocab / tp] (this rank's TP shard).
- ref:    the actor's architecture, frozen (requires_grad False, eval mode); `offload_to_cpu` / `reload` move its
          weights off the GPU between uses.
- critic: `output_layer` is a fresh `ValueHead`: the last stage returns values [B, T] (one per token).
- reward: the same head; read the value at the last non-pad token with `value_head.last_token_values`. The head's
          state-dict key is `output_layer.weight`, shape [1, hidden_size] (an HF `score.weight`).

Parameter names (local spec, this rank's shard; layer numbers are local to the pipeline chunk):
  embedding.word_embeddings.weight [padded_vocab/tp, H] (first stage), output_layer.weight (last stage; absent when
  tied, and a [1, H] value head for critic/reward), decoder.final_layernorm.weight,
  decoder.layers.N.{input_layernorm, pre_mlp_layernorm}.weight, self_attention.linear_qkv.{weight, bias}
  (per query group: q heads, k, v interleaved), self_attention.{q,k}_layernorm.weight (Qwen3),
  self_attention.linear_proj.weight, mlp.linear_fc1.weight ([gate; up]) / mlp.linear_fc2.weight; MoE:
  mlp.router.weight, mlp.experts.local_experts.E.linear_fc{1,2}.weight (E local to the EP rank),
  mlp.shared_experts.{linear_fc1, linear_fc2}.weight, mlp.shared_experts.gate_weight [1, H] (Qwen2-MoE).
  The transformer-engine spec fuses the norms into `self_attention.linear_qkv.layer_norm_weight` and
  `mlp.linear_fc1.layer_norm_weight`, and grouped experts are `mlp.experts.linear_fc{1,2}.weight<E>`.

See `megappo.models.chunk` for the layer spec and attention of each chunk.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
from torch import nn

from megappo.models.chunk import build_chunk
from megappo.models.hf_config import ModelSpecArgs, transformer_config_from_hf
from megappo.parallel import ParallelState
from megappo.platform.device import Platform
from megappo.platform.layout import ParallelLayout

ROLES = ("actor", "ref", "critic", "reward", "teacher")  # teacher: a frozen LM of its own (distillation)


def unwrap(model: nn.Module) -> nn.Module:
    """Strip DDP / Float16Module / FSDP wrappers (anything exposing `.module`) down to the GPTModel."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


def check_model_layout(layout: ParallelLayout, config: Any, spec: ModelSpecArgs, role: str) -> None:
    """LayoutError for a layout megatron-core cannot run this model's `role` at (beyond `check_layout`'s sizes)."""
    from megappo.models.attention import SDPAttention
    from megappo.models.layout.attention import check_context_parallel_attention
    from megappo.platform.layout import LayoutError

    check_context_parallel_attention(layout, spec.use_transformer_engine or SDPAttention.supports(config))
    if spec.num_experts and layout.tp > 1 and not layout.sequence_parallel and role in ("actor", "critic"):
        # megatron-core's MoELayer refuses to run in training mode with TP>1 unless sequence parallel is on.
        raise LayoutError(
            f"training a MoE {role} with tensor_model_parallel_size={layout.tp} needs sequence parallelism "
            "(megatron-core requirement); set actor_rollout_ref.actor.megatron.sequence_parallel=true, or use "
            "expert_model_parallel_size instead of tensor parallelism"
        )


def build_gpt_model(hf_dir_or_config: Any, role: str, parallel_state: ParallelState, platform: Platform, *,
                    seed: int = 0, config_overrides: Optional[Mapping[str, Any]] = None,
                    make_vocab_size_divisible_by: int = 128, freeze_vision_tower: bool = True) -> list[nn.Module]:
    """`build_model` of the text families: one GPTModel per virtual pipeline stage (`freeze_vision_tower`: no
    tower to freeze)."""
    from megatron.core import tensor_parallel

    from megappo.platform.layout import check_layout

    layout = parallel_state.layout
    config, spec = transformer_config_from_hf(
        hf_dir_or_config, layout, platform, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        **dict(config_overrides or {}),
    )
    check_layout(
        layout, parallel_state.world_size, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_query_groups, num_layers=config.num_layers, num_experts=spec.num_experts,
    )
    check_model_layout(layout, config, spec, role)
    stages = [None] if parallel_state.vpp_size is None else list(range(parallel_state.vpp_size))
    # Same seed and layout -> same initial weights (not across layouts: each pipeline stage draws its own layers).
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    chunks = []
    for vp_stage in stages:
        model = build_chunk(config, spec, role, parallel_state, platform, vp_stage, seed)
        if platform.is_cuda:
            model = model.to(platform.device)
        model.megappo_config = config
        model.megappo_spec = spec
        model.megappo_role = role
        if role in ("ref", "teacher"):
            model.eval()
            model.requires_grad_(False)
        chunks.append(model)
    return chunks


def offload_to_cpu(model_chunks: list[nn.Module]) -> None:
    """Move a frozen model's weights to (pinned) CPU memory; `reload` brings them back. A no-op on CPU."""
    for chunk in model_chunks:
        for t in list(chunk.parameters()) + list(chunk.buffers()):
            if t.device.type == "cuda":
                t.data = t.data.to("cpu", non_blocking=True).pin_memory()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def reload(model_chunks: list[nn.Module], device: torch.device) -> None:
    """Move weights offloaded by `offload_to_cpu` back to `device`."""
    if device.type != "cuda":
        return
    for chunk in model_chunks:
        for t in list(chunk.parameters()) + list(chunk.buffers()):
            if t.device != device:
                t.data = t.data.to(device, non_blocking=True)
    torch.cuda.synchronize()


def count_parameters(model_chunks: list[nn.Module]) -> int:
    """Parameters held by this rank (its TP/PP/EP shard)."""
    return sum(p.numel() for chunk in model_chunks for p in unwrap(chunk).parameters())


def model_config_summary(model_chunks: list[nn.Module], parallel_state: Optional[ParallelState] = None) -> str:
    """One human-readable paragraph: family, role, sizes, layout, spec and this rank's parameter count."""
    m = unwrap(model_chunks[0])
    cfg, spec, role = m.megappo_config, m.megappo_spec, m.megappo_role
    parts = [
        f"{spec.family} {role}: layers {cfg.num_layers} hidden {cfg.hidden_size} ffn {cfg.ffn_hidden_size} "
        f"heads {cfg.num_attention_heads} kv_heads {cfg.num_query_groups} head_dim {cfg.kv_channels} "
        f"vocab {spec.vocab_size} (padded {spec.padded_vocab_size}) tied {spec.share_embeddings_and_output_weights}",
        f"rope base {spec.rotary_base:g}"
        + (f" llama3-scaling x{spec.rope_scaling_factor:g}" if spec.rope_scaling else ""),
        f"dtype {cfg.params_dtype} spec {'transformer-engine' if spec.use_transformer_engine else 'local'}",
    ]
    if spec.num_experts:
        parts.append(
            f"moe experts {spec.num_experts} top{cfg.moe_router_topk} ffn {cfg.moe_ffn_hidden_size} "
            f"shared {cfg.moe_shared_expert_intermediate_size} pre_softmax {cfg.moe_router_pre_softmax} "
            f"dispatcher {cfg.moe_token_dispatcher_type}"
        )
    parts.append(f"tp {cfg.tensor_model_parallel_size} pp {cfg.pipeline_model_parallel_size} "
                 f"vpp {cfg.virtual_pipeline_model_parallel_size} cp {cfg.context_parallel_size} "
                 f"ep {cfg.expert_model_parallel_size} sp {cfg.sequence_parallel}")
    parts.append(f"chunks {len(model_chunks)} params on this rank {count_parameters(model_chunks):,}")
    if parallel_state is not None:
        parts.append(parallel_state.describe())
    return "; ".join(parts)
