"""A LoRA checkpoint exported with `convert mcore-to-hf --lora-only` loads with the real `peft` onto the HF base and
gives the megatron LoRA model's log-probs; `--merge-lora` gives a plain HF model with the same log-probs; the PEFT
directory read back as `model.lora.adapter_path` restores the adapters exactly."""
from __future__ import annotations

import pytest
import torch

from megappo.testing.dist import run_distributed

pytestmark = pytest.mark.multirank

PROMPTS = [[5, 17, 101, 9], [44, 3], [250, 251, 7, 8, 9]]
RESPONSES = [[33, 12, 90], [61, 2, 2, 140, 7], [18]]


def _batch():
    from megappo.models.batch import ModelBatch

    return ModelBatch.from_token_lists(PROMPTS, RESPONSES, pad_token_id=0)


def _job(rank, world_size, hf_dir, tmp):
    import json
    import os

    from megappo.convert.hf_to_mcore import load_hf_weights
    from megappo.convert.peft_io import load_peft_adapter, lora_to_hf
    from megappo.models.builder import build_model
    from megappo.models.checkpoint import save_model_checkpoint
    from megappo.models.compute import compute_log_probs
    from megappo.models.hf_config import load_hf_config_dict
    from megappo.models.lora import LoRASettings, adapters, apply_lora, base_checksum
    from megappo.parallel import destroy_parallel, init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout
    from megappo.trainer.checkpointing import LORA_BASE_FILE

    plat = detect_platform()
    lora = {"rank": 4, "alpha": 8.0, "target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
            "exclude_modules": []}

    def lora_actor():
        ps = init_parallel(ParallelLayout(), plat, seed=0)
        chunks = build_model(hf_dir, "actor", ps, plat, seed=1)
        load_hf_weights(chunks, hf_dir, ps)
        apply_lora(chunks, LoRASettings(rank=4, alpha=8.0, seed=2))
        return ps, chunks

    ps, chunks = lora_actor()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for ad in adapters(chunks):
            ad.lora_B.copy_(0.05 * torch.randn(ad.lora_B.shape, generator=g))
    lp, _ = compute_log_probs(chunks, _batch(), parallel_state=ps)
    ckpt = os.path.join(tmp, "global_step_1", "actor")
    save_model_checkpoint(chunks, ckpt)
    with open(os.path.join(ckpt, LORA_BASE_FILE), "w") as f:
        json.dump({"path": hf_dir, "sha256": base_checksum(hf_dir), "lora": lora}, f)
    destroy_parallel()
    peft_dir, merged_dir = os.path.join(tmp, "peft"), os.path.join(tmp, "merged")
    lora_to_hf(ckpt, peft_dir, lora_only=True, progress=False)
    destroy_parallel()
    lora_to_hf(ckpt, merged_dir, progress=False)
    destroy_parallel()
    ps, fresh = lora_actor()  # adapter_path: the PEFT directory read back
    n = load_peft_adapter(fresh, peft_dir, ps, load_hf_config_dict(hf_dir))
    back, _ = compute_log_probs(fresh, _batch(), parallel_state=ps)
    destroy_parallel()
    return {"lp": lp, "back": back, "n": n, "adapters": len(adapters(chunks)), "peft": peft_dir,
            "merged": merged_dir}


def _hf_log_probs(model):
    rows = []
    with torch.no_grad():
        for p, r in zip(PROMPTS, RESPONSES):
            ids = torch.tensor([p + r])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            rows.append(logp[len(p) - 1:-1].gather(1, torch.tensor(r).unsqueeze(1)).squeeze(1))
    out = torch.zeros(len(rows), max(len(r) for r in RESPONSES))
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def test_peft_and_merged_exports_match_megatron(hf_model_dir, tmp_path):
    peft = pytest.importorskip("peft")
    import json

    import transformers

    hf_dir = hf_model_dir("qwen2")
    r = run_distributed(_job, 1, hf_dir, str(tmp_path), timeout=300)[0]
    assert r["n"] == r["adapters"] > 0
    assert (r["back"] - r["lp"]).abs().max().item() == 0.0
    cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8.0
    assert sorted(cfg["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                              "v_proj"]
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    plain = _hf_log_probs(base)
    model = peft.PeftModel.from_pretrained(base, r["peft"]).eval()
    got = _hf_log_probs(model)
    mask = r["lp"] != 0
    assert (plain - r["lp"])[mask].abs().max().item() > 1e-3  # the adapters do change the model
    assert (got - r["lp"])[mask].abs().max().item() <= 1e-4
    merged = transformers.AutoModelForCausalLM.from_pretrained(r["merged"], torch_dtype=torch.float32)
    assert (_hf_log_probs(merged) - r["lp"])[mask].abs().max().item() <= 1e-4
