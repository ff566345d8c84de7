"""Fast checks of the conversion building blocks: tensor-parallel slicing, the safetensors writer and reader's
validation, the command line. No megatron model is built here (see test_convert_roundtrip.py)."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from megappo.convert.hf_io import HFCheckpoint, ShardedSafetensorsWriter
from megappo.convert.mapping import (
    ConversionError, ModelSpec, canonical_name, merge_to_hf, model_spec_from_hf_config, param_maps, shard_from_hf,
)
from megappo.testing import FAMILIES, tiny_hf_config


def _spec(**kw) -> ModelSpec:
    base = dict(family="qwen2", num_layers=1, hidden_size=8, num_heads=8, num_kv_heads=4, head_dim=2, vocab_size=10,
                ffn_size=12, num_experts=0, moe_ffn_size=0, shared_expert_size=0, shared_expert_gate=False,
                moe_layers=(False,), qkv_bias=True, qk_norm=False, tied_embeddings=False)
    return ModelSpec(**{**base, **kw})


def _reader(tensors):
    def read(name, dim, start, stop):
        t = tensors[name]
        return t if dim is None else t.narrow(dim, start, stop - start)
    return read


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shard_merge_roundtrip_every_kind(tp):
    """Every TP rank's shard, merged back, gives the HF tensors exactly (qkv per group, gate/up, vocab padding)."""
    spec = _spec()
    g = torch.Generator().manual_seed(0)
    hf = {}
    padded = 16  # megatron's padded vocabulary rows (> vocab_size 10)
    for pm in param_maps(spec):
        for name in pm.hf:
            if pm.kind == "qkv":
                rows = spec.num_heads * spec.head_dim if name.endswith(("q_proj.weight", "q_proj.bias")) \
                    else spec.num_kv_heads * spec.head_dim
                hf[name] = torch.randn((rows, 8) if name.endswith("weight") else (rows,), generator=g)
            elif pm.kind == "glu":
                hf[name] = torch.randn(12, 8, generator=g)
            elif pm.kind == "vocab":
                hf[name] = torch.randn(10, 8, generator=g)
            elif "o_proj" in name or "down_proj" in name:
                hf[name] = torch.randn(8, 8 if "o_proj" in name else 12, generator=g)
            else:
                hf[name] = torch.randn(8, generator=g)
    for pm in param_maps(spec):
        full = merge_to_hf(pm, spec, [_full_shard(pm, spec, hf, 0, 1, padded)])
        if pm.tp_dim is None:
            shards = [_full_shard(pm, spec, hf, 0, 1, padded)]
        else:
            shards = [_full_shard(pm, spec, hf, r, tp, padded) for r in range(tp)]
        for name, t in merge_to_hf(pm, spec, shards):
            assert torch.equal(t, hf[name]), (pm.mcore, name)
        for name, t in full:
            assert torch.equal(t, hf[name])


def _full_shard(pm, spec, hf, rank, size, padded):
    first = hf[pm.hf[0]]
    if pm.kind == "qkv":
        groups = spec.num_kv_heads // size
        shape = (groups * (spec.num_heads // spec.num_kv_heads + 2) * spec.head_dim, *first.shape[1:])
    elif pm.kind == "glu":
        shape = (2 * first.shape[0] // size, *first.shape[1:])
    elif pm.kind == "vocab":
        shape = (padded // size, first.shape[1])
    else:
        shape = list(first.shape)
        if pm.tp_dim is not None:
            shape[pm.tp_dim] //= size
    return shard_from_hf(pm, spec, _reader(hf), rank, size, tuple(shape))


def test_qkv_layout_is_interleaved_per_query_group():
    """megatron's fused qkv at TP1: per group g, its query heads then its key then its value head."""
    spec = _spec(num_heads=4, num_kv_heads=2, head_dim=1, hidden_size=1)
    q = torch.tensor([[0.0], [1.0], [2.0], [3.0]])
    k, v = torch.tensor([[10.0], [11.0]]), torch.tensor([[20.0], [21.0]])
    pm = next(p for p in param_maps(spec) if p.kind == "qkv" and p.mcore.endswith("weight"))
    out = shard_from_hf(pm, spec, _reader(dict(zip(pm.hf, (q, k, v)))), 0, 1, (8, 1))
    assert out.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    rank1 = shard_from_hf(pm, spec, _reader(dict(zip(pm.hf, (q, k, v)))), 1, 2, (4, 1))
    assert rank1.flatten().tolist() == [2, 3, 11, 21]


def test_vocab_padding_rows_are_zero_and_dropped():
    spec = _spec()
    pm = param_maps(spec)[0]
    emb = torch.arange(80, dtype=torch.float32).reshape(10, 8) + 1
    shards = [shard_from_hf(pm, spec, _reader({pm.hf[0]: emb}), r, 2, (8, 8)) for r in range(2)]
    assert torch.equal(shards[1][2:], torch.zeros(6, 8))  # rows 10..15 are megatron's padding
    assert torch.equal(merge_to_hf(pm, spec, shards)[0][1], emb)


def test_canonical_names_global_layer_and_expert_and_te_spellings():
    nums = [3, 4]  # a chunk holding global layers 2 and 3 (layer_number is 1-based)
    assert canonical_name("decoder.layers.1.mlp.linear_fc2.weight", nums, 0) == "decoder.layers.3.mlp.linear_fc2.weight"
    assert canonical_name("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", nums, 2) == \
        "decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight"
    assert canonical_name("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", nums, 0) == \
        "decoder.layers.2.input_layernorm.weight"
    assert canonical_name("decoder.layers.0.mlp.experts.linear_fc2.weight1", nums, 2) == \
        "decoder.layers.2.mlp.experts.local_experts.3.linear_fc2.weight"
    assert canonical_name("embedding.word_embeddings.weight", nums, 0) == "embedding.word_embeddings.weight"


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen2_tied", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral"])
def test_param_maps_name_every_saved_tensor_once(family, hf_model_dir):
    """The mapping names exactly the tensors transformers saves for the family (checkpoint names, not the fused
    in-memory MoE modules of transformers 5)."""
    ckpt = HFCheckpoint.open(hf_model_dir(family))
    mapped = [n for pm in param_maps(model_spec_from_hf_config(ckpt.config)) for n in pm.hf]
    assert len(mapped) == len(set(mapped))
    assert set(mapped) == set(ckpt.files)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_conversion_and_model_config_read_the_same_architecture(family):
    """The conversion mapping and transformer_config_from_hf agree on every architecture fact, per family."""
    from megappo.models.hf_config import transformer_config_from_hf
    from megappo.platform.layout import ParallelLayout
    from megappo.platform import Platform

    cfg = tiny_hf_config(family).to_dict()
    spec = model_spec_from_hf_config(cfg)
    c, s = transformer_config_from_hf(cfg, ParallelLayout(), Platform(torch.device("cpu"), "gloo", torch.float32))
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (
        c.num_layers, c.hidden_size, c.num_attention_heads, c.num_query_groups, c.kv_channels)
    assert spec.num_experts == (c.num_moe_experts or 0) == (s.num_experts or 0)
    if spec.num_experts:
        freq = c.moe_layer_freq
        assert list(spec.moe_layers) == ([True] * c.num_layers if freq == 1 else [bool(x) for x in freq])
        assert spec.moe_ffn_size == c.moe_ffn_hidden_size
    else:
        assert not any(spec.moe_layers)
    assert spec.shared_expert_size == (c.moe_shared_expert_intermediate_size or 0)
    assert spec.shared_expert_gate == bool(c.moe_shared_expert_gate)
    assert spec.qkv_bias == c.add_qkv_bias and spec.qk_norm == c.qk_layernorm == s.qk_layernorm
    assert spec.tied_embeddings == s.share_embeddings_and_output_weights
    assert spec.vocab_size == s.vocab_size and spec.ffn_size == c.ffn_hidden_size


def test_unsupported_architecture_names_config():
    with pytest.raises(ConversionError, match=r"my/config.json: unsupported model_type 'gpt2'"):
        model_spec_from_hf_config({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "my/config.json")


def test_writer_shards_index_and_transformers_reads_it(tmp_path):
    from safetensors.torch import load_file

    tensors = {f"t{i}": torch.randn(64, 32).to(torch.bfloat16 if i % 2 else torch.float32) for i in range(10)}
    w = ShardedSafetensorsWriter(str(tmp_path), max_shard_bytes=20_000)
    w.add_all(tensors.items())
    files = w.close()
    assert len(files) > 1 and not [f for f in os.listdir(tmp_path) if f.endswith(".partial")]
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    assert set(index["weight_map"]) == set(tensors) and index["metadata"]["total_size"] == w.total_bytes
    got = {k: v for f in files for k, v in load_file(str(tmp_path / f)).items()}
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)
    with pytest.raises(ConversionError, match="written twice"):
        w2 = ShardedSafetensorsWriter(str(tmp_path / "x"), 1 << 20)
        os.makedirs(tmp_path / "x")
        w2.add("a", torch.zeros(1))
        w2.add("a", torch.zeros(1))


def _hf_dir(tmp_path, hf_model_dir, family="llama"):
    d = tmp_path / "hf"
    shutil.copytree(hf_model_dir(family), d)
    return d


def test_reader_rejects_truncated_shard(tmp_path, hf_model_dir):
    d = _hf_dir(tmp_path, hf_model_dir)
    f = d / "model.safetensors"
    size = os.path.getsize(f)
    with open(f, "r+b") as fh:
        fh.truncate(size // 2)
    with pytest.raises(ConversionError, match=r"model\.safetensors: tensor '.+' ends at byte .* truncated"):
        HFCheckpoint.open(str(d))


def test_reader_rejects_index_naming_missing_file(tmp_path, hf_model_dir):
    d = _hf_dir(tmp_path, hf_model_dir)
    ckpt = HFCheckpoint.open(str(d))
    weight_map = {n: ("model-00001-of-00002.safetensors" if i % 2 else "model.safetensors")
                  for i, n in enumerate(ckpt.files)}
    json.dump({"metadata": {}, "weight_map": weight_map}, open(d / "model.safetensors.index.json", "w"))
    with pytest.raises(ConversionError, match=r"index.json: names shard 'model-00001-of-00002.safetensors', which is "
                                              r"missing"):
        HFCheckpoint.open(str(d))


def test_reader_slices_without_loading_everything(tmp_path, hf_model_dir):
    from safetensors.torch import load_file

    d = hf_model_dir("qwen2")
    ckpt = HFCheckpoint.open(d)
    ref = load_file(os.path.join(d, "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(ckpt.read(name, 1, 32, 96), ref[name][:, 32:96])
    assert torch.equal(ckpt.read(name, 0, 8, 16), ref[name][8:16])
    with pytest.raises(ConversionError, match="does not match its config.json"):
        ckpt.read(name, 0, 0, 1000)


def test_cli_help_and_torchrun_hint(capsys, monkeypatch):
    from megappo.cli import main

    for argv in (["convert", "--help"], ["convert", "hf-to-mcore", "--help"], ["convert", "mcore-to-hf", "--help"],
                 ["convert", "verify", "--help"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--max-shard-size" in out and "--atol" in out and "torchrun --nproc-per-node" in out
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit, match=r"(?s)needs 4 ranks.*torchrun --nproc-per-node 4 -m megappo.cli convert hf-to-mcore"):
        main(["convert", "hf-to-mcore", "--hf", "x", "--out", "y", "--tp", "2", "--pp", "2"])
