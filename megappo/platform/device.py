"""The one place that decides device, process-group backend, dtype and seeds.

`detect_platform()` picks CUDA when present (NCCL, bf16) and CPU otherwise (gloo, fp32). Choosing the CPU also
applies `megappo.platform.cpu_compat`, the small adaptation of megatron-core's CUDA assumptions, so no caller can
forget it; on CUDA nothing is patched.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Optional, Union

import torch

_DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}


@dataclass(frozen=True)
class Platform:
    """Where this process computes.

    device: cuda:<LOCAL_RANK> or cpu. backend: torch.distributed backend ("nccl" or "gloo").
    dtype: parameter/compute dtype of the models (bf16 on GPU, fp32 on CPU unless configured).
    """

    device: torch.device
    backend: str
    dtype: torch.dtype

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def parse_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    """`"bf16"`/`"fp32"`/`torch.float32`... -> torch.dtype; an unknown name lists the accepted ones."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}") from None


def detect_platform(device: str = "auto", dtype: Optional[Union[str, torch.dtype]] = None) -> Platform:
    """Choose the platform for this process.

    device: "auto" (CUDA when available, else CPU), "cuda" or "cpu". dtype: None for the default of the device
    (bf16 on CUDA, fp32 on CPU) or a name/torch.dtype. On CUDA the device index is LOCAL_RANK (torchrun/Ray set it).
    On CPU, `cpu_compat.apply_cpu_compat()` is applied here.
    """
    if device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"device must be 'auto', 'cuda' or 'cpu', got {device!r}")
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError(
            "device='cuda' was requested but torch sees no CUDA GPU (torch.version.cuda="
            f"{torch.version.cuda}); install a CUDA build of torch or set device='cpu'"
        )
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        dev = torch.device("cuda", local_rank % torch.cuda.device_count())
        return Platform(dev, "nccl", parse_dtype(dtype) if dtype is not None else torch.bfloat16)
    if torch.cuda.is_available():
        # megatron-core allocates on the current CUDA device in many places; a CPU run on a GPU machine would mix
        # devices, and the CPU adaptation below refuses to patch a working CUDA runtime.
        raise RuntimeError(
            "device='cpu' on a machine with CUDA is not supported for megatron models; use device='auto' or hide the "
            "GPUs with CUDA_VISIBLE_DEVICES=''"
        )
    from megappo.platform.cpu_compat import apply_cpu_compat

    apply_cpu_compat()
    return Platform(torch.device("cpu"), "gloo", parse_dtype(dtype) if dtype is not None else torch.float32)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy, torch (CPU and CUDA) and, when megatron's model parallel state is initialised,
    megatron's model-parallel RNG tracker (different streams per TP rank, same across DP ranks)."""
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
