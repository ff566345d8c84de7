"""Shared test setup: one torch thread per process, the test tiers' markers, and cached tiny HF models."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def pytest_configure(config):
    try:
        import torch

        torch.set_num_threads(1)  # measured 3-4x faster than 2 threads on the 2-core CI machine
    except ImportError:
        pass


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on a GPU machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory):
    """`hf_model_dir(family, seq_cls=False)` -> path of a cached tiny random HF model of that family."""
    from megappo.testing import make_hf_model

    cache: dict[tuple[str, bool], str] = {}

    def get(family: str, seq_cls: bool = False) -> str:
        key = (family, seq_cls)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"hf_{family}{'_cls' if seq_cls else ''}")
            cache[key] = make_hf_model(family, str(out), seq_cls=seq_cls)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """Path of a tiny trained tokenizer with a chat template."""
    from megappo.testing import make_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(str(out))
    return str(out)
