"""Prompt datasets: verl-schema Parquet files, tokenised prompts, and a resumable batch loader."""
from megappo.data.errors import DataError

__all__ = ["DataError", "EpochSampler", "PromptBatch", "PromptDataset", "PromptLoader", "collate"]


def __getattr__(name: str):
    # Lazy so `megappo data --help` and reward workers do not import torch.
    if name in ("PromptBatch", "PromptDataset", "collate"):
        from megappo.data import dataset

        return getattr(dataset, name)
    if name in ("EpochSampler", "PromptLoader"):
        from megappo.data import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'megappo.data' has no attribute {name!r}")
