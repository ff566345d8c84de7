"""What the GPU tests of the server engines share (tests/gpu): the CUDA environment of an engine, and transformers'
bf16 log-probs of fixed tokens, which a server's are compared with (bf16 greedy tokens may differ where two logits tie
within rounding; a wrong or stale weight moves the log-probs by far more than the tolerance)."""
from __future__ import annotations

import os
import subprocess
import sys

TOKENS = [5, 9, 17, 3, 30, 12, 8, 2, 41, 7]
ATOL = 5e-2  # a bf16 server vs bf16 transformers


def cuda_engine_python(package: str, env: str) -> str:
    """The python that has `package` for CUDA: $`env`, else this one; skips the test without a GPU or the package."""
    import pytest
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    python = os.environ.get(env, sys.executable)
    probe = subprocess.run([python, "-c", f"import {package}"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"{package} is not installed for {python} (set {env}): {probe.stderr[-300:]}")
    return python


def reference_log_probs(model_dir: str, tokens: list[int] = TOKENS) -> list[float]:
    """transformers' bf16 log p(tokens[k] | tokens[:k]), k >= 1, on CUDA."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor([tokens], device="cuda")
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0].tolist()
