"""vLLM servers on CUDA: what tests/e2e/test_vllm_fleet.py and tests/e2e/test_trainer_vllm.py check on vLLM's CPU
build, on the CUDA wheel megappo[vllm] pins (vLLM 0.32.0): log-probs against transformers in bf16, a reload from
disk, abort with partial tokens, a TP2 server, and the trainer with a CUDA vLLM rollout (disk and distributed sync).
Run with `pytest -m gpu tests/gpu` (tools/gpu_check.sh) where vLLM is installed for CUDA: in this Python, or in the
one MEGAPPO_VLLM_PYTHON names.

bf16 on GPU: greedy tokens may differ where two logits tie within rounding, so the checks compare the server's
log-probs of fixed tokens with transformers' on the same weights (a wrong or stale weight moves them by far more
than the tolerance)."""
from __future__ import annotations

import threading
import time

import pytest

from megappo.testing.gpu import ATOL, TOKENS, reference_log_probs

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]


def _server(model: str, python: str, tp: int = 1):
    from megappo.rollout.vllm.server import VLLMServer

    return VLLMServer(model, python=python, dtype="bfloat16", gpu_memory_utilization=0.3, tensor_parallel_size=tp,
                      gpus=range(tp), max_model_len=512, extra_args=["--logprobs-mode", "processed_logprobs"])


@pytest.mark.parametrize("tp", [1, 2])
def test_a_cuda_server_scores_reloads_and_aborts(cuda_vllm_python, hf_model_dir, tmp_path, tp):
    import torch

    from megappo.rollout import SamplingParams
    from megappo.rollout.vllm.fleet import VLLMFleet
    from megappo.testing.hf_models import make_hf_model

    if torch.cuda.device_count() < tp:
        pytest.skip(f"a TP{tp} server needs {tp} GPUs")
    first = make_hf_model("qwen2", str(tmp_path / "first"), seed=5, dtype=torch.bfloat16)
    second = make_hf_model("qwen2", str(tmp_path / "second"), seed=6, dtype=torch.bfloat16)
    with _server(first, cuda_vllm_python, tp) as server:
        fleet = VLLMFleet([server.url], api_key=server.api_key)
        assert fleet.prompt_log_probs(TOKENS)[0] == pytest.approx(reference_log_probs(first), abs=ATOL)
        fleet.pause()
        assert fleet.update_weights_from_disk(second, version=1) == 1
        fleet.resume()
        fleet.check_version(1)
        assert fleet.prompt_log_probs(TOKENS)[0] == pytest.approx(reference_log_probs(second), abs=ATOL)

        result: dict = {}
        long = SamplingParams(max_new_tokens=400, temperature=1.0, seed=1, ignore_eos=True)
        worker = threading.Thread(target=lambda: result.update(out=fleet.generate([[5, 6, 7]] * 4, long)))
        worker.start()
        time.sleep(0.2)
        fleet.abort()
        worker.join(timeout=60)
        assert all(c.finish_reason in ("abort", "length") for g in result["out"] for c in g)
        assert any(c.finish_reason == "abort" for g in result["out"] for c in g)


@pytest.mark.parametrize("mode, sync", [("async", "disk"), ("async", "distributed"), ("sync", "tensor")])
def test_trainer_with_a_cuda_vllm_rollout(cuda_vllm_python, hf_model_dir, tmp_path, mode, sync):
    """Two PPO steps on CUDA in bf16 whose rollout is vLLM on the trainer's GPU: a server the trainer starts (async),
    or vLLM's engine in the trainer's process, asleep while it trains (sync); after each sync the engine's log-probs
    match the trainer's (verify_sync)."""
    import importlib.util
    import sys
    from megappo.config import load_config
    from megappo.testing.prompts import read_metrics, tiny_run_overrides, write_prompt_parquet
    from megappo.trainer import fit

    if mode == "sync" and importlib.util.find_spec("vllm") is None:
        pytest.skip(f"mode=sync runs vLLM in the trainer's python ({sys.executable}), which has no vllm")
    train = write_prompt_parquet(str(tmp_path / "train.parquet"), 16)
    cfg = load_config("gsm8k/tiny_cpu", tiny_run_overrides(
        str(tmp_path / "run"), hf_model_dir("qwen2"), train, steps=2,
        extra=["trainer.device=cuda", "actor_rollout_ref.model.dtype=bfloat16", "actor_rollout_ref.rollout.name=vllm",
               f"actor_rollout_ref.rollout.mode={mode}",
               f"actor_rollout_ref.rollout.server_python={cuda_vllm_python}",
               "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
               f"actor_rollout_ref.rollout.weight_sync={sync}", "actor_rollout_ref.rollout.verify_sync=true"]))
    assert fit(cfg) == 0
    rows = read_metrics(str(tmp_path / "run"))
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollout/verify_sync_max_diff"] <= ATOL for r in rows)
    assert rows[1]["rollout/weight_version"] == 2
