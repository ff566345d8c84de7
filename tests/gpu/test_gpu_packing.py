"""Packed micro-batches (use_remove_padding) on a GPU: transformer-engine's THD attention (varlen kernels) gives
each row's padded-path log-probs and values. bf16 (TE's THD kernels are half-precision), so the tolerance is bf16's;
the fp32 1e-5 exactness is tested on CPU (tests/multirank/test_packing_exact.py). Run with `pytest -m gpu`."""
from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_ps():
    from megappo.parallel import destroy_parallel, init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout
    from megappo.testing.dist import free_port

    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port())).items():
        os.environ.setdefault(k, v)
    platform = detect_platform()
    ps = init_parallel(ParallelLayout(), platform, seed=0)
    yield platform, ps
    destroy_parallel(destroy_process_group=True)


def test_packed_matches_padded_with_transformer_engine(cuda_ps, hf_model_dir):
    import torch

    from megappo.kinds.build import build_model
    from megappo.kinds.weights import load_hf_weights
    from megappo.models.batch import ModelBatch
    from megappo.models.builder import unwrap
    from megappo.models.compute import MicroBatching, compute_log_probs, compute_values
    from megappo.models.layout.plan import can_pack

    platform, ps = cuda_ps
    hf_dir = hf_model_dir("qwen2")
    g = torch.Generator().manual_seed(5)
    plens, rlens = [3, 8, 2, 5], [40, 4, 27, 9]
    prompts = [torch.randint(1, 400, (n,), generator=g).tolist() for n in plens]
    responses = [torch.randint(1, 400, (n,), generator=g).tolist() for n in rlens]
    batch = ModelBatch.from_token_lists(prompts, responses, pad_token_id=0).to(platform.device)
    for role in ("actor", "critic"):
        chunks = build_model(hf_dir, role, ps, platform, seed=1)
        load_hf_weights(chunks, hf_dir, ps)
        if not getattr(unwrap(chunks[0]).megappo_spec, "use_transformer_engine", False):
            pytest.skip("transformer-engine is not installed: the GPU's packed path is TE's")
        assert can_pack(chunks, ps)
        outs = []
        for packed in (False, True):
            micro = MicroBatching(micro_batch_size=4, packed=packed)
            if role == "actor":
                outs.append(compute_log_probs(chunks, batch, parallel_state=ps, micro=micro)[0])
            else:
                outs.append(compute_values(chunks, batch, parallel_state=ps, micro=micro))
        torch.testing.assert_close(outs[1], outs[0], rtol=3e-2, atol=3e-2)
