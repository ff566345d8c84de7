"""rollout.lora_sync=adapter on GPU: an SGLang server started with megappo's LoRA flags (`lora_server_args`) serves a
PEFT adapter directory as the actor (`SGLangFleet.load_lora_adapter`), requests name it, and the next sync's adapter
replaces it. Run with `pytest -m gpu tests/gpu` where SGLang is installed for CUDA (MEGAPPO_SGLANG_PYTHON). On CPU
the switch is refused: tests/unit/test_lora_config.py, and tests/e2e/test_sglang_cpu_lora.py measures why."""
from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.sglang]
TOKENS = [5, 9, 17, 3, 30, 12, 8, 2, 41, 7]
ATOL = 5e-2  # bf16 server vs bf16 transformers + peft


def _peft_dir(model_dir: str, out: str, seed: int) -> str:
    import peft
    import torch
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    return out


def _peft_log_probs(model_dir: str, adapter: str) -> list[float]:
    import peft
    import torch
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    model = peft.PeftModel.from_pretrained(base, adapter).eval()
    ids = torch.tensor([TOKENS], device="cuda")
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0].tolist()


def test_sglang_serves_the_synced_adapter(hf_model_dir, tmp_path):
    import os
    import subprocess
    import sys

    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    python = os.environ.get("MEGAPPO_SGLANG_PYTHON", sys.executable)
    if subprocess.run([python, "-c", "import sglang"], capture_output=True).returncode != 0:
        pytest.skip(f"SGLang is not installed for {python} (set MEGAPPO_SGLANG_PYTHON)")
    pytest.importorskip("peft")
    from megappo.config import load_config
    from megappo.platform import detect_platform
    from megappo.rollout.sglang.fleet import SGLangFleet
    from megappo.rollout.sglang.server import SGLangServer
    from megappo.rollout.sglang.server_set import lora_server_args

    model = hf_model_dir("qwen2")
    cfg = load_config("recipes/cpu/tiny_ppo_lora.yaml", [f"actor_rollout_ref.model.path={model}",
                                                          "actor_rollout_ref.model.lora.rank=4",
                                                          "actor_rollout_ref.rollout.name=sglang",
                                                          "actor_rollout_ref.rollout.lora_sync=adapter",
                                                          "trainer.device=cuda"])
    from megappo.trainer.settings import rollout_settings

    flags = lora_server_args(rollout_settings(cfg), detect_platform())
    assert flags[:3] == ["--enable-lora", "--max-lora-rank", "4"]
    first, second = (_peft_dir(model, str(tmp_path / f"a{s}"), s) for s in (1, 2))
    with SGLangServer(model, python=python, cuda=True, dtype="bfloat16",
                      extra_args=["--mem-fraction-static", "0.3", *flags]) as server:
        fleet = SGLangFleet([server.url])
        plain = fleet.prompt_log_probs(TOKENS)[0]
        for version, adapter in ((1, first), (2, second)):
            fleet.pause()
            fleet.load_lora_adapter(adapter, version=version)
            fleet.resume()
            fleet.check_version(version)
            got = fleet.prompt_log_probs(TOKENS)[0]
            want = _peft_log_probs(model, adapter)
            assert max(abs(a - b) for a, b in zip(got, want)) < ATOL, (version, got, want)
            assert max(abs(a - b) for a, b in zip(got, plain)) > 10 * ATOL  # the adapter is applied
        assert fleet.engines[0].lora_name == "megappo_v2"
