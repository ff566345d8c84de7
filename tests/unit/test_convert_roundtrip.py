"""HF -> megatron dist_checkpoint -> HF for every family, in one process (TP1): every tensor bit-identical (both
export paths: streamed from the checkpoint files, and through the live model's iter_hf_weights), transformers loads
the output with the same logits, `verify` passes; value heads; bad inputs leave nothing behind.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from megappo.convert.mapping import ConversionError

FAMILIES = ["llama", "qwen2", "qwen2_tied", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral"]


def _tensors(d) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out


def _assert_bit_identical(src, out, ignore=()):
    a, b = _tensors(src), _tensors(out)
    a = {k: v for k, v in a.items() if k not in ignore}
    b = {k: v for k, v in b.items() if k not in ignore}
    assert sorted(a) == sorted(b), set(a) ^ set(b)
    bad = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not bad, f"{len(bad)} tensors differ, e.g. {bad[:3]}"


def _leftovers(parent) -> list[str]:
    return [f for f in os.listdir(parent) if ".tmp" in f]


@pytest.mark.parametrize("family", FAMILIES)
def test_roundtrip_bit_identical_and_same_logits(family, hf_model_dir, tmp_path):
    import transformers

    from megappo.convert.verify import verify_tokens
    from megappo.kinds.commands import hf_to_mcore, mcore_to_hf, verify

    src = hf_model_dir(family)
    mc, out = str(tmp_path / "mcore"), str(tmp_path / "hf")
    assert hf_to_mcore(src, mc, progress=False, bucket_bytes=64 << 10)["buckets"] > 2  # streamed in buckets
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.exists(os.path.join(mc, name)), name
    r = verify(src, mc)  # TP1 megatron vs transformers
    assert r["ok"] and r["max_abs_diff"] < 1e-4, r
    # small shards so that the index path is exercised too
    summary = mcore_to_hf(mc, out, max_shard_bytes=300_000, progress=False)
    assert summary["tensors"] == len(_tensors(src))
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    _assert_bit_identical(src, out)
    # the same through the live model and iter_hf_weights (the trainer's weight-sync path)
    mcore_to_hf(mc, str(tmp_path / "hf_from_model"), from_model=True, progress=False)
    _assert_bit_identical(src, tmp_path / "hf_from_model")
    assert not _leftovers(tmp_path)

    ids = verify_tokens(512, 2, 12)
    with torch.no_grad():
        ref = transformers.AutoModelForCausalLM.from_pretrained(src).eval()(input_ids=ids).logits
        got = transformers.AutoModelForCausalLM.from_pretrained(out).eval()(input_ids=ids).logits
    assert torch.equal(ref, got)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template


def test_critic_from_causal_lm_and_reward_from_seq_cls(hf_model_dir, tmp_path):
    """critic: causal-LM body + fresh value head, exported as *ForSequenceClassification; reward: score.weight
    <-> value head, bit-identical both ways; verify compares per-token values."""
    import transformers

    from megappo.kinds.commands import hf_to_mcore, mcore_to_hf, verify

    lm = hf_model_dir("llama")
    hf_to_mcore(lm, str(tmp_path / "critic"), role="critic", progress=False)
    mcore_to_hf(str(tmp_path / "critic"), str(tmp_path / "critic_hf"), progress=False)
    mcore_to_hf(str(tmp_path / "critic"), str(tmp_path / "critic_hf2"), from_model=True, progress=False)
    _assert_bit_identical(tmp_path / "critic_hf", tmp_path / "critic_hf2")
    cfg = json.load(open(tmp_path / "critic_hf" / "config.json"))
    assert cfg["architectures"] == ["LlamaForSequenceClassification"] and cfg["num_labels"] == 1
    _assert_bit_identical(lm, tmp_path / "critic_hf", ignore=("lm_head.weight", "score.weight"))
    head = _tensors(tmp_path / "critic_hf")["score.weight"]
    assert head.shape == (1, 64) and head.abs().sum() > 0
    model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "critic_hf")
    assert torch.equal(model.score.weight.detach(), head)
    assert verify(str(tmp_path / "critic_hf"), str(tmp_path / "critic"))["max_abs_diff"] < 1e-4

    rm = hf_model_dir("qwen2", seq_cls=True)
    hf_to_mcore(rm, str(tmp_path / "reward"), role="reward", progress=False)
    r = verify(rm, str(tmp_path / "reward"))
    assert r["role"] == "reward" and r["shape"] == (2, 16) and r["max_abs_diff"] < 1e-4
    mcore_to_hf(str(tmp_path / "reward"), str(tmp_path / "reward_hf"), progress=False)
    _assert_bit_identical(rm, tmp_path / "reward_hf")

    # a critic initialised from a reward model takes its score head
    hf_to_mcore(rm, str(tmp_path / "critic_from_rm"), role="critic", progress=False)
    mcore_to_hf(str(tmp_path / "critic_from_rm"), str(tmp_path / "critic_from_rm_hf"), progress=False)
    _assert_bit_identical(rm, tmp_path / "critic_from_rm_hf")

    with pytest.raises(ConversionError, match="score.weight"):
        hf_to_mcore(lm, str(tmp_path / "bad_reward"), role="reward", progress=False)


def _copy(hf_model_dir, tmp_path, family="llama"):
    d = tmp_path / "src"
    shutil.copytree(hf_model_dir(family), d)
    return d


def test_bad_inputs_fail_naming_file_and_tensor_and_leave_nothing(hf_model_dir, tmp_path):
    from megappo.cli import main
    from megappo.kinds.commands import hf_to_mcore

    out = tmp_path / "out"
    # unsupported architecture
    d = _copy(hf_model_dir, tmp_path)
    cfg = json.load(open(d / "config.json"))
    json.dump({**cfg, "model_type": "gpt2"}, open(d / "config.json", "w"))
    with pytest.raises(ConversionError, match=r"src/config.json: unsupported model_type 'gpt2'"):
        hf_to_mcore(str(d), str(out), progress=False)
    # shape mismatch: config.json and weights disagree
    json.dump({**cfg, "intermediate_size": 96}, open(d / "config.json", "w"))
    with pytest.raises(ConversionError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.gate_proj\.weight' "
                                              r"has shape \(128, 64\) but config.json implies \(96, 64\)"):
        hf_to_mcore(str(d), str(out), progress=False)
    # a shard cut in half (through the command line: exit code 2, message on stderr)
    json.dump(cfg, open(d / "config.json", "w"))
    f = d / "model.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 2)
    assert main(["convert", "hf-to-mcore", "--hf", str(d), "--out", str(out)]) == 2
    assert not out.exists() and not _leftovers(tmp_path)

    # an existing output is kept without --force; with it, only an empty directory or megappo's own is replaced
    good = hf_model_dir("llama")
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match="already exists; pass --force"):
        hf_to_mcore(good, str(out), progress=False)
    assert (out / "keep.txt").exists()
    assert main(["convert", "hf-to-mcore", "--hf", good, "--out", str(out), "--force"]) == 2  # not megappo's
    assert (out / "keep.txt").exists()
    os.remove(out / "keep.txt")
    assert main(["convert", "hf-to-mcore", "--hf", good, "--out", str(out), "--force"]) == 0  # empty
    assert main(["convert", "hf-to-mcore", "--hf", good, "--out", str(out), "--force"]) == 0  # megappo's
    assert not (out / "keep.txt").exists() and (out / "megappo_checkpoint.json").exists()
    # mcore-to-hf: refuses an existing output, and names a truncated dist_checkpoint file
    hf_out = tmp_path / "hf_out"
    hf_out.mkdir()
    assert main(["convert", "mcore-to-hf", "--mcore", str(out), "--out", str(hf_out)]) == 2
    distcp = sorted(p for p in os.listdir(out) if p.endswith(".distcp"))[0]
    with open(out / distcp, "r+b") as fh:
        fh.truncate(10)
    with pytest.raises(Exception, match=rf"{distcp} is truncated"):
        from megappo.kinds.commands import mcore_to_hf

        mcore_to_hf(str(out), str(tmp_path / "hf_out2"), progress=False)
    assert not (tmp_path / "hf_out2").exists() and not _leftovers(tmp_path)


def test_dtype_conversion_bf16(hf_model_dir, tmp_path):
    """--dtype bf16 stores bf16 parameters; the export equals the source cast to bf16, and says so in config.json."""
    from megappo.cli import main

    src = hf_model_dir("qwen3")
    assert main(["convert", "hf-to-mcore", "--hf", src, "--out", str(tmp_path / "m"), "--dtype", "bf16"]) == 0
    assert main(["convert", "mcore-to-hf", "--mcore", str(tmp_path / "m"), "--out", str(tmp_path / "h")]) == 0
    a, b = _tensors(src), _tensors(tmp_path / "h")
    assert all(b[k].dtype == torch.bfloat16 and torch.equal(a[k].to(torch.bfloat16), b[k]) for k in a)
    assert json.load(open(tmp_path / "h" / "config.json"))["dtype"] == "bfloat16"
    # float32 export of the bf16 checkpoint, through the command line
    assert main(["convert", "mcore-to-hf", "--mcore", str(tmp_path / "m"), "--out", str(tmp_path / "h32"),
                 "--dtype", "fp32"]) == 0
    assert all(v.dtype == torch.float32 for v in _tensors(tmp_path / "h32").values())
