"""GPU-only paths: CUDA platform (NCCL, bf16), no CPU adaptation, the transformer-engine layer spec, offload of the
reference model, and a checkpoint round trip on the GPU. Run on a GPU machine with `pytest -m gpu tests/gpu`."""
from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_state():
    """A world-1 NCCL process group and megatron's groups, torn down after the module."""
    import torch.distributed as dist

    from megappo.platform.layout import ParallelLayout
    from megappo.parallel import destroy_parallel, init_parallel
    from megappo.platform import detect_platform
    from megappo.testing.dist import free_port

    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port())).items():
        os.environ.setdefault(k, v)
    platform = detect_platform()
    ps = init_parallel(ParallelLayout(), platform, seed=0)
    yield platform, ps
    destroy_parallel(destroy_process_group=True)
    assert not dist.is_initialized()


def _batch(device):
    import torch

    ids = torch.randint(0, 500, (2, 16), device=device)
    return ids, torch.arange(16, device=device).expand(2, 16)


def test_cuda_platform_defaults(cuda_state):
    import torch
    import torch.distributed as dist

    from megappo.platform import cpu_compat

    platform, _ = cuda_state
    assert platform.is_cuda and platform.backend == "nccl" and platform.dtype == torch.bfloat16
    assert dist.get_backend() == "nccl"
    assert not cpu_compat.cpu_compat_applied()
    with pytest.raises(RuntimeError, match="CPU-only"):
        cpu_compat.apply_cpu_compat()


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_bf16_actor_forward_backward_and_spec(cuda_state, hf_model_dir, family):
    import torch

    from megappo.kinds.build import build_model
    from megappo.models.builder import unwrap
    from megappo.models.hf_config import transformer_engine_available

    platform, ps = cuda_state
    chunks = build_model(hf_model_dir(family), "actor", ps, platform)
    model = unwrap(chunks[0])
    assert model.megappo_spec.use_transformer_engine == transformer_engine_available()
    if transformer_engine_available():
        assert any(type(m).__name__.startswith("TE") for m in model.modules()), "TE spec not used"
    assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in model.parameters())
    logits = model(*_batch(platform.device), None)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()
    logits.float().mean().backward()
    assert model.embedding.word_embeddings.weight.grad is not None and model.output_layer.weight.grad is not None


def test_ref_offload_and_reload(cuda_state, hf_model_dir):
    import torch

    from megappo.kinds.build import build_model
    from megappo.models.builder import offload_to_cpu, reload

    platform, ps = cuda_state
    ref = build_model(hf_model_dir("llama"), "ref", ps, platform)
    assert not any(p.requires_grad for p in ref[0].parameters()) and not ref[0].training
    with torch.no_grad():
        before = ref[0](*_batch(platform.device), None).float()
    used = torch.cuda.memory_allocated()
    offload_to_cpu(ref)
    assert all(p.device.type == "cpu" for p in ref[0].parameters())
    assert torch.cuda.memory_allocated() < used
    reload(ref, platform.device)
    with torch.no_grad():
        after = ref[0](*_batch(platform.device), None).float()
    assert torch.equal(before, after)


def test_checkpoint_round_trip_on_gpu(cuda_state, hf_model_dir, tmp_path):
    import torch

    from megappo.kinds.build import build_model
    from megappo.models.checkpoint import load_model_checkpoint, save_model_checkpoint

    platform, ps = cuda_state
    a = build_model(hf_model_dir("qwen2"), "critic", ps, platform, seed=1)
    b = build_model(hf_model_dir("qwen2"), "critic", ps, platform, seed=2)
    batch = _batch(platform.device)
    save_model_checkpoint(a, str(tmp_path / "ck"))
    load_model_checkpoint(b, str(tmp_path / "ck"))
    with torch.no_grad():
        assert torch.equal(a[0](*batch, None), b[0](*batch, None))


def test_padded_log_probs_match_transformers_with_the_gpu_attention(cuda_state, hf_model_dir):
    """transformer-engine / flash attention take a causal mask type and ignore padding masks: megappo runs rows
    left-aligned, so a left-padded batch must still give each row's unpadded log-probs (fp32, no TF32)."""
    import torch
    import transformers

    from megappo.kinds.build import build_model
    from megappo.kinds.weights import load_hf_weights
    from megappo.models.batch import ModelBatch
    from megappo.models.compute import MicroBatching, compute_log_probs
    from megappo.platform import detect_platform

    _, ps = cuda_state
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    platform = detect_platform(dtype="float32")
    hf_dir = hf_model_dir("qwen2")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 400, (n,), generator=g).tolist() for n in (2, 9, 5)]
    responses = [torch.randint(1, 400, (n,), generator=g).tolist() for n in (7, 1, 4)]
    batch = ModelBatch.from_token_lists(prompts, responses, pad_token_id=0)
    chunks = build_model(hf_dir, "actor", ps, platform)
    load_hf_weights(chunks, hf_dir, ps)
    logp, _ = compute_log_probs(chunks, batch.to(platform.device), parallel_state=ps,
                                micro=MicroBatching(micro_batch_size=3))
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).to("cuda").eval()
    for i, (p, r) in enumerate(zip(prompts, responses)):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + r], device="cuda")).logits[0, len(p) - 1: len(p) + len(r) - 1]
        ref = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(r, device="cuda")[:, None])[:, 0]
        torch.testing.assert_close(logp[i, : len(r)].to("cuda"), ref, rtol=1e-3, atol=1e-3)
