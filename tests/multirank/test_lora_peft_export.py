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

    from megappo.config.schema import LoRAConfig
    from megappo.convert.peft_io import load_peft_adapter
    from megappo.kinds.build import build_model
    from megappo.kinds.commands import lora_to_hf
    from megappo.kinds.weights import load_hf_weights
    from megappo.models.checkpoint import save_model_checkpoint
    from megappo.models.compute import compute_log_probs
    from megappo.models.hf_config import load_hf_config_dict
    from megappo.models.lora import LORA_BASE_FILE, adapters, apply_lora, base_checksum
    from megappo.parallel import destroy_parallel, init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout
    from megappo.trainer.settings import lora_settings

    plat = detect_platform()
    lora = {"rank": 4, "alpha": 8.0, "target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
            "exclude_modules": []}

    def lora_actor():
        ps = init_parallel(ParallelLayout(), plat, seed=0)
        chunks = build_model(hf_dir, "actor", ps, plat, seed=1)
        load_hf_weights(chunks, hf_dir, ps)
        apply_lora(chunks, lora_settings(LoRAConfig(rank=4, alpha=8.0), seed=2))
        return ps, chunks

    ps, chunks = lora_actor()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for ad in adapters(chunks):
            ad.lora_B.copy_(0.05 * torch.randn(ad.lora_B.shape, generator=g))
    lp, _ = compute_log_probs(chunks, _batch(), parallel_state=ps)
    from megappo.config.schema import LoRAConfig
    from megappo.convert.peft_io import write_sync_adapter

    # rollout.lora_sync=adapter's directory (what SGLang loads): the same adapter as the export
    sync_dir, sync_bytes = write_sync_adapter(chunks, ps, load_hf_config_dict(hf_dir), os.path.join(tmp, "sync_v3"),
                                              LoRAConfig(rank=4, alpha=8.0), hf_dir, torch.float32)
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
            "merged": merged_dir, "sync": sync_dir, "sync_bytes": sync_bytes}


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
    from safetensors.torch import load_file

    exported, synced = (load_file(f"{d}/adapter_model.safetensors") for d in (r["peft"], r["sync"]))
    assert exported.keys() == synced.keys() and all(torch.equal(exported[k], synced[k]) for k in exported)
    assert r["sync_bytes"] == sum(t.numel() * 4 for t in synced.values())
    assert json.loads((tmp_path / "sync_v3" / "adapter_config.json").read_text())["target_modules"] == \
        cfg["target_modules"]
    merged = transformers.AutoModelForCausalLM.from_pretrained(r["merged"], torch_dtype=torch.float32)
    assert (_hf_log_probs(merged) - r["lp"])[mask].abs().max().item() <= 1e-4


def _layout_job(rank, world_size, hf_dir, tmp, layout):
    """A LoRA actor at `layout` (random B everywhere, experts included): its log-probs, and its `--lora-only` export
    written at the same layout (the stages' layers and the EP ranks' experts gathered into one directory)."""
    import json
    import os

    import torch.distributed as dist

    from megappo.config.schema import LoRAConfig
    from megappo.kinds.build import build_model
    from megappo.kinds.commands import lora_to_hf
    from megappo.kinds.weights import load_hf_weights
    from megappo.models.checkpoint import save_model_checkpoint
    from megappo.models.compute import compute_log_probs
    from megappo.models.lora import LORA_BASE_FILE, adapters, apply_lora, base_checksum
    from megappo.parallel import destroy_parallel, init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout
    from megappo.trainer.settings import lora_settings

    plat = detect_platform()
    ps = init_parallel(ParallelLayout(**layout), plat, seed=0)
    chunks = build_model(hf_dir, "actor", ps, plat, seed=1)
    load_hf_weights(chunks, hf_dir, ps)
    apply_lora(chunks, lora_settings(LoRAConfig(rank=4, alpha=8.0), seed=2))
    with torch.no_grad():  # B seeded by the layer's global name: the same adapters at every layout
        for ad in adapters(chunks):
            g = torch.Generator().manual_seed(sum(map(ord, ad.name)))
            full = 0.05 * torch.randn((ad.lora_B.shape[0] * ad.tp_size if ad.kind == "column" else
                                       ad.lora_B.shape[0], ad.lora_B.shape[1]), generator=g)
            ad.lora_B.copy_(full.chunk(ad.tp_size)[ps.tp_rank] if ad.kind == "column" else full)
    lp, _ = compute_log_probs(chunks, _batch(), parallel_state=ps)  # every DP rank the same rows
    tag = "_".join(f"{k}{v}" for k, v in layout.items())
    ckpt = os.path.join(tmp, f"ckpt_{tag}")
    save_model_checkpoint(chunks, ckpt)
    if rank == 0:
        lora = {"rank": 4, "alpha": 8.0, "target_modules": list(LoRAConfig().target_modules), "exclude_modules": []}
        with open(os.path.join(ckpt, LORA_BASE_FILE), "w") as f:
            json.dump({"path": hf_dir, "sha256": base_checksum(hf_dir), "lora": lora}, f)
    n_experts = sum(".local_experts." in a.name for a in adapters(chunks))
    dist.barrier()
    destroy_parallel()
    out = os.path.join(tmp, f"peft_{tag}")
    lora_to_hf(ckpt, out, lora_only=True, progress=False, **layout)
    destroy_parallel()
    return {"lp": lp, "peft": out, "local_expert_adapters": n_experts} if rank == 0 else None


def _peft_log_probs(hf_dir, peft_dir):
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    plain = _hf_log_probs(base)
    return plain, _hf_log_probs(peft.PeftModel.from_pretrained(base, peft_dir).eval())


@pytest.mark.long  # ~70 s each on the 2-core machine
@pytest.mark.parametrize("family, layout", [("qwen2", {"pp": 2}), ("qwen3_moe", {"ep": 2})], ids=["pp2", "moe_ep2"])
def test_peft_export_at_pp_and_ep(hf_model_dir, tmp_path, family, layout):
    """`--lora-only` at PP=2 (each stage's layers) and EP=2 with adapters on the MoE experts: the real peft loads the
    directory onto the HF base with the megatron model's log-probs. The experts are written per expert as PEFT
    names them for transformers v4 (`mlp.experts.{e}.gate_proj`, ...); peft 0.21 on transformers v5 converts them
    to its `target_parameters` adapters on the fused `gate_up_proj` / `down_proj` (rank 2r for the fused pair)."""
    pytest.importorskip("peft")
    import json

    from safetensors import safe_open

    hf_dir = hf_model_dir(family)
    r = run_distributed(_layout_job, 2, hf_dir, str(tmp_path), layout, timeout=300)[0]
    with safe_open(f"{r['peft']}/adapter_model.safetensors", "pt") as f:
        keys = list(f.keys())
    cfg = json.loads((tmp_path / f"peft_{'_'.join(f'{k}{v}' for k, v in layout.items())}" /
                      "adapter_config.json").read_text())
    n_layers = len({k.split(".layers.")[1].split(".")[0] for k in keys})
    assert n_layers == json.load(open(f"{hf_dir}/config.json"))["num_hidden_layers"], "every stage's layers"
    if family == "qwen3_moe":
        experts = {k.split(".experts.")[1].split(".")[0] for k in keys if ".experts." in k}
        hf_cfg = json.loads(open(f"{hf_dir}/config.json").read())
        n = hf_cfg.get("num_experts") or hf_cfg.get("num_local_experts")
        assert r["local_expert_adapters"] > 0 and len(experts) == n, ("every EP rank's experts", experts, n)
        assert {"gate_proj", "up_proj", "down_proj"} <= set(cfg["target_modules"])
    plain, got = _peft_log_probs(hf_dir, r["peft"])
    mask = r["lp"] != 0
    assert (plain - r["lp"])[mask].abs().max().item() > 1e-3
    assert (got - r["lp"])[mask].abs().max().item() <= 1e-4
