"""Why rollout.lora_sync=adapter is refused on CPU: SGLang's CPU backend dies at start with --enable-lora (its LoRA
layer wrappers allocate pinned host memory, which needs an accelerator). Should a later SGLang start, this fails
and says to lift the refusal (megappo/rollout/sglang/limits.py SGLANG_CPU_LORA, server_set.lora_server_args)."""
from __future__ import annotations

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.long]  # ~30 s: one server start on the 2-core machine


def test_sglang_cpu_backend_cannot_serve_lora(sglang_python, hf_model_dir):
    from megappo.rollout.sglang.server import SGLangServer

    model = hf_model_dir("qwen2")
    flags = ["--enable-lora", "--max-lora-rank", "4", "--lora-target-modules", "q_proj", "k_proj", "v_proj",
             "o_proj", "gate_proj", "up_proj", "down_proj", "--max-loras-per-batch", "2"]
    server = SGLangServer(model, python=sglang_python, extra_args=flags)
    try:
        with pytest.raises(RuntimeError, match="pin_memory") as failed:
            server.start(timeout=300)
    finally:
        server.stop()
    assert "pin_memory=True requires a CUDA" in str(failed.value), str(failed.value)[-2000:]
