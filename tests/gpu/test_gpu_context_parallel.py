"""Context parallelism on GPUs: transformer-engine's own CP attention (megatron's TE spec, NCCL) gives the CP=1
log-probs and values, and a training step's loss. bf16, so the tolerance is bf16's; the fp32 1e-5 exactness of
megappo's CP (SDPAttention's all-gather scheme) is tested on CPU in tests/multirank/test_compute.py. Needs two
GPUs; run with `pytest -m gpu tests/gpu`."""
from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.gpu


def _job(rank, world_size, hf_dir, port):
    import torch
    import torch.distributed as dist

    from megappo.kinds.build import build_model
    from megappo.kinds.weights import load_hf_weights
    from megappo.models.batch import ModelBatch
    from megappo.models.builder import unwrap
    from megappo.models.compute import MicroBatching, compute_log_probs, compute_values
    from megappo.parallel import destroy_parallel, init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout

    # run_distributed starts gloo; TE's CP attention needs NCCL: rejoin on a fresh port as a CUDA world
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    platform = detect_platform()
    g = torch.Generator().manual_seed(5)
    plens, rlens = [3, 8, 2, 5], [40, 4, 27, 9]
    prompts = [torch.randint(1, 400, (n,), generator=g).tolist() for n in plens]
    responses = [torch.randint(1, 400, (n,), generator=g).tolist() for n in rlens]
    batch = ModelBatch.from_token_lists(prompts, responses, pad_token_id=0).to(platform.device)
    out = {}
    for cp in (1, 2):  # cp 1: two data-parallel ranks, each on the whole batch
        ps = init_parallel(ParallelLayout(cp=cp), platform, seed=0)
        for role in ("actor", "critic"):
            chunks = build_model(hf_dir, role, ps, platform, seed=1)
            load_hf_weights(chunks, hf_dir, ps)
            out["te"] = bool(getattr(unwrap(chunks[0]).megappo_spec, "use_transformer_engine", False))
            micro = MicroBatching(micro_batch_size=2)
            if role == "actor":
                out[(cp, role)] = compute_log_probs(chunks, batch, parallel_state=ps, micro=micro)[0].cpu()
            else:
                out[(cp, role)] = compute_values(chunks, batch, parallel_state=ps, micro=micro).cpu()
        destroy_parallel()
    return out


def test_te_context_parallel_matches_cp1(hf_model_dir):
    import torch

    from megappo.models.hf_config import transformer_engine_available
    from megappo.testing.dist import free_port, run_distributed

    if torch.cuda.device_count() < 2:
        pytest.skip("context parallelism on GPUs needs two of them")
    if not transformer_engine_available():
        pytest.skip("transformer-engine is not installed: the GPU's CP attention is TE's")
    results = run_distributed(_job, 2, hf_model_dir("qwen2"), free_port(), timeout=600)
    for r in results:
        assert r["te"]
        for role in ("actor", "critic"):
            torch.testing.assert_close(r[(2, role)], r[(1, role)], rtol=3e-2, atol=3e-2)
