"""The platform choice and the CPU-only adaptation of megatron-core: each item works on CPU and is off on CUDA."""
from __future__ import annotations

import pytest
import torch

from megappo.platform import detect_platform, parse_dtype
from megappo.platform import cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only adaptation; GPU covered in tests/gpu")


@pytest.fixture(scope="module")
def cpu_platform():
    return detect_platform()  # applies cpu_compat


def test_detect_platform_cpu_defaults(cpu_platform):
    assert cpu_platform.device == torch.device("cpu")
    assert cpu_platform.backend == "gloo" and cpu_platform.dtype == torch.float32 and not cpu_platform.is_cuda
    assert cpu_compat.cpu_compat_applied()
    assert detect_platform("cpu", dtype="bf16").dtype == torch.bfloat16


def test_detect_platform_errors_name_the_fix():
    with pytest.raises(RuntimeError, match="set device='cpu'"):
        detect_platform("cuda")
    with pytest.raises(ValueError, match="'auto', 'cuda' or 'cpu'"):
        detect_platform("tpu")
    with pytest.raises(ValueError, match="use one of"):
        parse_dtype("fp8")


def test_adaptation_refuses_to_run_where_cuda_exists(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="CPU-only"):
        cpu_compat.apply_cpu_compat()
    with pytest.raises(RuntimeError, match="not supported"):
        detect_platform("cpu")
    # The scoped mode is a no-op on CUDA: a CUDA allocation inside is a real CUDA allocation (fails on this build).
    with cpu_compat.cuda_to_cpu():
        with pytest.raises((AssertionError, RuntimeError)):
            torch.zeros(1, device="cuda")


def test_apply_is_idempotent(cpu_platform):
    assert cpu_compat.apply_cpu_compat() and cpu_compat.apply_cpu_compat()


def test_rng_tracker_on_cpu_generator(cpu_platform):
    """Item 1: model_parallel_cuda_manual_seed and the tracker's fork run on the CPU generator."""
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(5, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    torch.manual_seed(0)
    outside_before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outside_before)  # the default stream is restored
    with tracker.fork():
        b = torch.rand(3)
    assert not torch.equal(a, b)  # the tracked stream advanced
    tensor_parallel.model_parallel_cuda_manual_seed(5, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        assert torch.equal(torch.rand(3), a)  # reproducible from the seed
    tensor_parallel.model_parallel_cuda_manual_seed(5, tp_rank=1, ep_rank=0, etp_rank=0, force_reset_rng=True)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        assert not torch.equal(torch.rand(3), a)  # another TP rank gets another stream


def test_cuda_device_queries(cpu_platform):
    """Item 2."""
    assert torch.cuda.current_device() == torch.device("cpu")
    torch.cuda.synchronize()
    assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"


def test_module_local_factory_redirects(cpu_platform):
    """Items 3, 5, 6: only the named megatron modules see the redirect; torch itself still rejects CUDA."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer import utils as tutils
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    assert schedules.torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    mask = tutils.get_default_causal_mask(4)
    assert mask.device.type == "cpu" and mask[0, 1] and not mask[1, 0]
    assert moe_utils.te_general_gemm is None
    s = token_dispatcher.torch.cuda.Stream()
    assert s is token_dispatcher.torch.cuda.current_stream()
    with token_dispatcher.torch.cuda.stream(s):
        s.wait_stream(s)
    assert token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([2, 3]), as_numpy=True).tolist() == [2, 3]
    assert not torch.is_tensor(token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([2, 3]), as_numpy=True))
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")


def test_scoped_mode_for_tensor_methods(cpu_platform):
    """Item 4: inside cuda_to_cpu() CUDA allocations land on the CPU and .type() reports CUDA names."""
    t = torch.ones(2)
    assert t.type() == "torch.FloatTensor"
    with cpu_compat.cuda_to_cpu():
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert t.cuda() is t
        assert t.to("cuda").device.type == "cpu"
        assert t.type() == "torch.cuda.FloatTensor"
        assert t.bfloat16().type() == "torch.cuda.BFloat16Tensor"
    assert t.type() == "torch.FloatTensor"


def test_megatron_clip_grad_and_grad_scaler_run(cpu_platform):
    """Item 4 through the wrapped megatron functions (they allocate on 'cuda' and assert CUDA types)."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler

    # (get_grad_norm_fp32 all-reduces; the optimizer step in tests/multirank/test_checkpoint.py covers it)
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 3.0)
    clip_grads.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=6.0)
    assert p.grad.norm().item() == pytest.approx(1.0, rel=1e-4)
    assert ConstantGradScaler(2.0).scale.device.type == "cpu"
