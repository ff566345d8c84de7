"""SGLang's GPU paths: weight sync over NCCL, colocated sync by CUDA IPC handles, a TP2 server, and the trainer with
a CUDA SGLang rollout. Run with `pytest -m gpu tests/gpu` (tools/gpu_check.sh) on a machine where SGLang is
installed for CUDA: in this Python, or in the one MEGAPPO_SGLANG_PYTHON names. The CPU tests of the same paths are
tests/e2e/test_sglang_fleet.py and tests/e2e/test_trainer_sglang.py (gloo, shared memory).

bf16 on GPU: greedy tokens may differ where two logits tie within rounding, so the checks compare the server's
log-probs of fixed tokens with transformers' on the same weights (a wrong or stale weight moves them by far more
than the tolerance).
"""
from __future__ import annotations

import os

import pytest

from megappo.testing.gpu import ATOL, TOKENS, reference_log_probs

pytestmark = [pytest.mark.gpu, pytest.mark.sglang]


def _buckets_on_cuda(model_dir: str, per_bucket: int = 4) -> list:
    import torch
    from safetensors.torch import load_file

    tensors = sorted((n, t.to("cuda", torch.bfloat16)) for n, t in
                     load_file(os.path.join(model_dir, "model.safetensors")).items())
    return [tensors[i:i + per_bucket] for i in range(0, len(tensors), per_bucket)]


def _server(model: str, python: str, tp: int = 1):
    from megappo.rollout.sglang.server import SGLangServer

    extra = ["--mem-fraction-static", "0.3"] + (["--tp", str(tp)] if tp > 1 else [])
    return SGLangServer(model, python=python, cuda=True, dtype="bfloat16", extra_args=extra)


@pytest.mark.parametrize("tp", [1, 2])
def test_nccl_and_cuda_ipc_weight_sync(cuda_sglang_python, hf_model_dir, tmp_path, tp):
    """distributed (NCCL broadcast into the server's TP ranks) and tensor (CUDA IPC handles) each leave the server
    with exactly the new weights and the new version."""
    import torch

    from megappo.rollout.sglang.fleet import SGLangFleet
    from megappo.testing.hf_models import make_hf_model

    if torch.cuda.device_count() < tp:
        pytest.skip(f"a TP{tp} server needs {tp} GPUs")
    model = hf_model_dir("qwen2")
    first = make_hf_model("qwen2", str(tmp_path / "first"), seed=5)
    second = make_hf_model("qwen2", str(tmp_path / "second"), seed=6)
    with _server(model, cuda_sglang_python, tp) as server:
        fleet = SGLangFleet([server.url], tp_size=tp, backend="nccl")
        fleet.pause()
        assert fleet.update_weights(_buckets_on_cuda(first), version=1) == 1
        fleet.resume()
        fleet.check_version(1)
        assert fleet.prompt_log_probs(TOKENS)[0] == pytest.approx(reference_log_probs(first), abs=ATOL)
        fleet.close_weight_group()

        fleet.pause()
        assert fleet.update_weights_from_tensor(_buckets_on_cuda(second), version=2) == 2
        fleet.resume()
        fleet.check_version(2)
        assert fleet.prompt_log_probs(TOKENS)[0] == pytest.approx(reference_log_probs(second), abs=ATOL)


@pytest.mark.parametrize("sync", ["distributed", "tensor"])
def test_trainer_with_a_cuda_sglang_rollout(cuda_sglang_python, hf_model_dir, tmp_path, sync):
    """Two PPO steps on CUDA in bf16 whose rollout is an SGLang server the trainer starts on the same GPU; after
    each sync the server's log-probs match the trainer's (verify_sync), and the server is gone afterwards."""
    from megappo.config import load_config
    from megappo.testing.prompts import read_metrics, tiny_run_overrides, write_prompt_parquet
    from megappo.trainer import fit

    train = write_prompt_parquet(str(tmp_path / "train.parquet"), 16)
    cfg = load_config("gsm8k/tiny_cpu", tiny_run_overrides(
        str(tmp_path / "run"), hf_model_dir("qwen2"), train, steps=2,
        extra=["trainer.device=cuda", "actor_rollout_ref.model.dtype=bfloat16", "actor_rollout_ref.rollout.name=sglang",
               f"actor_rollout_ref.rollout.server_python={cuda_sglang_python}",
               "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
               f"actor_rollout_ref.rollout.weight_sync={sync}", "actor_rollout_ref.rollout.verify_sync=true"]))
    assert fit(cfg) == 0
    rows = read_metrics(str(tmp_path / "run"))
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollout/verify_sync_max_diff"] <= ATOL for r in rows)
    assert rows[1]["rollout/weight_version"] == 2 and rows[1]["perf/weight_sync_gbps"] > 0
