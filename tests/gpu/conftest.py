"""The CUDA environments of the server engines (megappo/testing/gpu.py): a test that needs one skips without it."""
from __future__ import annotations

import pytest

from megappo.testing.gpu import cuda_engine_python


@pytest.fixture(scope="module")
def cuda_sglang_python() -> str:
    return cuda_engine_python("sglang", "MEGAPPO_SGLANG_PYTHON")


@pytest.fixture(scope="module")
def cuda_vllm_python() -> str:
    return cuda_engine_python("vllm", "MEGAPPO_VLLM_PYTHON")
