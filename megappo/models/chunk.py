"""One megatron-core `GPTModel` pipeline chunk of a role (`build_chunk`): the layer spec, megappo's SDPA attention
and, for critic and reward, the value head. `megappo.models.builder` builds a text model's chunks from it and a
vision-language kind its language model (`megappo.kinds.qwen2_vl.model`).

Layer spec: transformer-engine's when CUDA is used and TE imports, megatron's local spec otherwise (MoE and QK norm
follow the TransformerConfig). With sequence parallelism the local spec's norms are replaced by
`SequenceParallelTorchNorm` (megatron's torch norm refuses SP), which makes SP, and so MoE x TP training, run on CPU.
The local spec's core attention is `megappo.models.attention.SDPAttention` (torch's fused SDPA kernels) instead of
megatron's `DotProductAttention`; such a chunk has `.megappo_sdpa_attention` True and needs no causal mask passed.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from megappo.models.hf_config import ModelSpecArgs
from megappo.models.value_head import ValueHead
from megappo.parallel import ParallelState
from megappo.platform.device import Platform


class SequenceParallelTorchNorm:
    """megatron's local-spec norm (torch RMSNorm/LayerNorm) usable with sequence parallelism.

    megatron's `WrappedTorchNorm` refuses sequence parallelism only because it does not flag its parameters: with
    the sequence split over TP ranks each rank sees part of the tokens, so the norm's gradients must be summed over
    TP, which `finalize_model_grads` does for parameters with `sequence_parallel=True` (as TE/Apex norms set).
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_: Any) -> nn.Module:
        norms = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}
        if config.normalization not in norms:
            raise ValueError(f"normalization {config.normalization!r} unsupported; use one of {sorted(norms)}")
        norm = norms[config.normalization](hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


def _replace_module_class(spec: Any, old: type, new: type) -> Any:
    """Return `spec` (ModuleSpec / submodule dataclasses / lists, as megatron nests them) with class `old` -> `new`."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec

    if spec is old:
        return new
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(spec, module=_replace_module_class(spec.module, old, new),
                                   submodules=_replace_module_class(spec.submodules, old, new))
    if isinstance(spec, (list, tuple)):
        return type(spec)(_replace_module_class(x, old, new) for x in spec)
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(spec, **{f.name: _replace_module_class(getattr(spec, f.name), old, new)
                                            for f in dataclasses.fields(spec) if f.init})
    return spec


def _stage_flags(parallel_state: ParallelState, vp_stage: Optional[int]) -> tuple[bool, bool]:
    """(pre_process, post_process) of this rank's chunk `vp_stage` in the (interleaved) pipeline."""
    from megatron.core import parallel_state as mpu

    if parallel_state.vpp_size is None:
        return parallel_state.is_pipeline_first_stage, parallel_state.is_pipeline_last_stage
    return (
        mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
    )


def build_chunk(config, spec: ModelSpecArgs, role: str, parallel_state: ParallelState, platform: Platform,
                 vp_stage: Optional[int], seed: int) -> nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    pre, post = _stage_flags(parallel_state, vp_stage)
    block_spec = get_gpt_decoder_block_spec(
        config, use_transformer_engine=spec.use_transformer_engine, normalization=spec.normalization,
        vp_stage=vp_stage, pp_rank=parallel_state.pp_rank,
    )
    if config.sequence_parallel and not spec.use_transformer_engine:
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        block_spec = _replace_module_class(block_spec, WrappedTorchNorm, SequenceParallelTorchNorm)
    from megappo.models.attention import SDPAttention

    sdpa = not spec.use_transformer_engine and SDPAttention.supports(config)
    if sdpa:  # torch's fused attention kernels instead of megatron's baddbmm + mask + softmax (models/attention.py)
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        block_spec = _replace_module_class(block_spec, DotProductAttention, SDPAttention)
    value_model = role in ("critic", "reward")
    model = GPTModel(
        config=config,
        transformer_layer_spec=block_spec,
        vocab_size=spec.padded_vocab_size,
        max_sequence_length=spec.max_sequence_length,
        pre_process=pre,
        post_process=post,
        parallel_output=True,  # logits stay vocab-parallel: no rank materialises the full vocabulary
        # A value model has its own head; its embedding is never tied to it.
        share_embeddings_and_output_weights=spec.share_embeddings_and_output_weights and not value_model,
        position_embedding_type=spec.position_embedding_type,
        rotary_percent=spec.rotary_percent,
        rotary_base=spec.rotary_base,
        rope_scaling=spec.rope_scaling,
        rope_scaling_factor=spec.rope_scaling_factor,
        seq_len_interpolation_factor=spec.seq_len_interpolation_factor,
        pg_collection=parallel_state.pg_collection,
        vp_stage=vp_stage,
    )
    model.megappo_sdpa_attention = sdpa  # its attention applies the causal mask itself: no mask needs passing
    from megappo.models.layout.prefix import install_prefix_positions

    install_prefix_positions(model)  # shared-prefix packs carry their own rotary positions
    if not spec.use_transformer_engine and config.params_dtype != torch.float32:
        # The local spec's torch norms ignore params_dtype (megatron casts them later in Float16Module, which
        # megappo does not use): give them the model dtype like every other parameter.
        for module in model.modules():
            if isinstance(module, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
                module.to(config.params_dtype)
    if value_model and post:
        model.output_layer = ValueHead(
            config.hidden_size, std=config.init_method_std, dtype=config.params_dtype,
            device=platform.device,
            sequence_parallel=config.sequence_parallel, tp_group=parallel_state.tp_group, seed=seed + 1,
        )
    return model
