"""TransformerConfig + GPTModel arguments from Hugging Face configs of every supported family (no distributed)."""
from __future__ import annotations

import pytest
import torch

from megappo.models.hf_config import UnsupportedModelError, pad_vocab_size, transformer_config_from_hf
from megappo.platform.layout import LayoutError, ParallelLayout
from megappo.platform import Platform, detect_platform
from megappo.testing import tiny_hf_config


@pytest.fixture(scope="module")
def cpu():
    return detect_platform("cpu")


def _cfg(family, layout=ParallelLayout(), platform=None, **hf_overrides):
    hf = tiny_hf_config(family, **hf_overrides).to_dict()
    return transformer_config_from_hf(hf, layout, platform or detect_platform("cpu"))


def test_llama(cpu):
    c, s = _cfg("llama", platform=cpu)
    assert (c.num_layers, c.hidden_size, c.ffn_hidden_size) == (4, 64, 128)
    assert (c.num_attention_heads, c.num_query_groups, c.kv_channels) == (4, 2, 16)
    assert c.normalization == "RMSNorm" and c.layernorm_epsilon == 1e-6
    assert c.gated_linear_unit and c.activation_func is torch.nn.functional.silu
    assert not c.add_bias_linear and not c.add_qkv_bias and not c.qk_layernorm
    assert c.use_cpu_initialization and c.params_dtype == torch.float32 and not c.bf16
    assert c.num_moe_experts is None
    assert s.family == "llama" and s.rotary_base == 500000.0 and not s.rope_scaling
    assert not s.share_embeddings_and_output_weights and s.padded_vocab_size == 1024
    assert s.max_sequence_length == 512 and not s.use_transformer_engine


def test_qwen2_bias_and_tying(cpu):
    c, s = _cfg("qwen2", platform=cpu)
    assert c.add_qkv_bias and not c.add_bias_linear and not s.share_embeddings_and_output_weights
    _, s = _cfg("qwen2_tied", platform=cpu)
    assert s.share_embeddings_and_output_weights and s.rotary_base == 1e6


def test_qwen3_qk_norm_and_explicit_head_dim(cpu):
    c, _ = _cfg("qwen3", platform=cpu, head_dim=32)
    assert c.qk_layernorm and not c.add_qkv_bias and c.kv_channels == 32  # not hidden/heads = 16


def test_qwen2_moe(cpu):
    c, s = _cfg("qwen2_moe", platform=cpu)
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size) == (4, 2, 32)
    assert c.moe_shared_expert_intermediate_size == 64 and c.moe_shared_expert_gate
    assert c.moe_router_pre_softmax  # norm_topk_prob false: softmax over all experts, no renormalisation
    assert c.moe_router_score_function == "softmax" and c.moe_aux_loss_coeff == 0.0
    assert c.moe_token_dispatcher_type == "allgather" and not c.moe_grouped_gemm and not c.add_bias_linear
    assert c.add_qkv_bias and c.moe_layer_freq == 1 and s.num_experts == 4
    c, _ = _cfg("qwen2_moe", platform=cpu, mlp_only_layers=[1])
    assert c.moe_layer_freq == [1, 0, 1, 1]


def test_qwen3_moe_and_mixtral(cpu):
    c, _ = _cfg("qwen3_moe", platform=cpu)
    assert c.num_moe_experts == 4 and not c.moe_router_pre_softmax and c.qk_layernorm
    assert c.moe_shared_expert_intermediate_size is None and not c.add_qkv_bias
    c, _ = _cfg("mixtral", platform=cpu)
    assert (c.num_moe_experts, c.moe_ffn_hidden_size) == (4, 128) and not c.moe_router_pre_softmax


def test_rope_scaling_transformers4_and_5(cpu):
    llama3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    base = tiny_hf_config("llama").to_dict()
    base.pop("rope_parameters", None)
    v4 = {**base, "rope_theta": 10000.0, "rope_scaling": llama3}
    v5 = {**base, "rope_parameters": {**llama3, "rope_theta": 10000.0}}
    for hf in (v4, v5):
        _, s = transformer_config_from_hf(hf, ParallelLayout(), cpu)
        assert s.rope_scaling and s.rope_scaling_factor == 32.0 and s.rotary_base == 10000.0
    _, s = transformer_config_from_hf({**base, "rope_theta": 5e5}, ParallelLayout(), cpu)
    assert s.rotary_base == 5e5 and not s.rope_scaling
    _, s = transformer_config_from_hf({**base, "rope_scaling": {"type": "linear", "factor": 2.0}}, ParallelLayout(), cpu)
    assert s.seq_len_interpolation_factor == 2.0
    with pytest.raises(UnsupportedModelError, match="supported: default, llama3, linear"):
        transformer_config_from_hf({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, ParallelLayout(), cpu)
    with pytest.raises(UnsupportedModelError, match="low_freq_factor"):
        transformer_config_from_hf({**base, "rope_scaling": {**llama3, "low_freq_factor": 2.0}}, ParallelLayout(), cpu)


def test_vocab_padding_and_layout_fields(cpu):
    assert pad_vocab_size(500, 1) == 1024 and pad_vocab_size(1025, 2) == 2048
    # The same padded size at every TP up to 8, so a TP2 checkpoint of Qwen's vocabulary loads at TP1.
    assert {pad_vocab_size(151936, tp) for tp in (1, 2, 4, 8)} == {152576}
    assert pad_vocab_size(151936, 16) == 153600  # past 8 the multiple grows with tp
    c, s = _cfg("qwen2_moe", layout=ParallelLayout(tp=2, pp=2, ep=2), platform=cpu, vocab_size=513)
    assert s.padded_vocab_size == 1024 and s.vocab_size == 513
    assert (c.tensor_model_parallel_size, c.pipeline_model_parallel_size, c.expert_model_parallel_size) == (2, 2, 2)
    assert c.variable_seq_lengths and c.moe_token_dispatcher_type == "alltoall"  # megatron: allgather can't


def test_dtype_and_overrides(cpu):
    bf16 = Platform(torch.device("cpu"), "gloo", torch.bfloat16)
    c, _ = transformer_config_from_hf(tiny_hf_config("llama").to_dict(), ParallelLayout(), bf16,
                                      recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    assert c.bf16 and c.params_dtype == torch.bfloat16 and c.pipeline_dtype == torch.bfloat16
    assert c.recompute_granularity == "full"
    with pytest.raises(TypeError, match="unknown TransformerConfig fields"):
        transformer_config_from_hf(tiny_hf_config("llama").to_dict(), ParallelLayout(), cpu, not_a_field=1)


def test_unsupported_models_list_supported_families(cpu, tmp_path):
    with pytest.raises(UnsupportedModelError, match="supported families: llama, qwen2, qwen3, qwen2_moe"):
        transformer_config_from_hf({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, ParallelLayout(), cpu)
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        _cfg("llama", platform=cpu, hidden_act="gelu")
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        _cfg("qwen2", platform=cpu, use_sliding_window=True, sliding_window=128)
    with pytest.raises(FileNotFoundError, match="config.json"):
        transformer_config_from_hf(str(tmp_path), ParallelLayout(), cpu)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        transformer_config_from_hf(str(tmp_path), ParallelLayout(), cpu)


def test_model_directory_input(cpu, hf_model_dir):
    c, s = transformer_config_from_hf(hf_model_dir("qwen3"), ParallelLayout(), cpu)
    assert c.qk_layernorm and s.hf_architecture == "Qwen3ForCausalLM"


def test_invalid_layouts_fail_before_any_process_group(cpu, monkeypatch):
    import torch.distributed as dist

    from megappo.parallel import destroy_parallel, init_parallel

    destroy_parallel(destroy_process_group=True)  # an earlier test in this worker may have left its 1-rank group
    monkeypatch.setenv("WORLD_SIZE", "4")
    cases = [
        (ParallelLayout(tp=3), {}, "choose sizes whose product divides 4"),
        (ParallelLayout(tp=4), dict(num_key_value_heads=2), "does not divide num_key_value_heads=2"),
        (ParallelLayout(pp=4), dict(num_layers=6), "num_hidden_layers=6 is not divisible"),
        (ParallelLayout(ep=4), dict(num_experts=6), "does not divide num_experts=6"),
        (ParallelLayout(tp=1, sequence_parallel=True), {}, "sequence_parallel=true needs"),
    ]
    for layout, dims, message in cases:
        with pytest.raises(LayoutError, match=message):
            init_parallel(layout, cpu, **dims)
    assert not dist.is_initialized()
