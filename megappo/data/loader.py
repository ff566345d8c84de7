"""Batches of prompts in a seeded per-epoch order, with a position that checkpoints save and restore.

The order of epoch e is a permutation drawn from numpy's PCG64 seeded with (seed, e), so it depends only on the
seed, the epoch and the dataset size: a resumed run, given the saved (epoch, batch) position, yields exactly the
batches the uninterrupted run would have.

    loader = PromptLoader(dataset, batch_size=1024, shuffle=True, seed=1)
    loader.load_state_dict(ckpt["dataloader"])            # when resuming
    for epoch in range(loader.epoch, total_epochs):
        for batch in loader:                              # the rest of this epoch, then loader.epoch += 1
            ...
            ckpt["dataloader"] = loader.state_dict()
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from megappo.data.dataset import PromptBatch, PromptDataset
from megappo.data.errors import DataError


class EpochSampler:
    """Dataset indices for each epoch, cut into batches of `batch_size`."""

    def __init__(self, num_items: int, batch_size: int, *, shuffle: bool = True, seed: int = 1,
                 drop_last: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.num_items, self.batch_size = num_items, batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        if len(self) == 0:
            raise ValueError(
                f"batch size {batch_size} is larger than the dataset ({num_items} prompts), so an epoch has no "
                "full batch; lower data.train_batch_size or add prompts"
            )

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(self.num_items, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def order(self, epoch: int) -> np.ndarray:
        """[num_items] int64: the epoch's permutation of dataset indices (identity without shuffle)."""
        if not self.shuffle:
            return np.arange(self.num_items)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_items)

    def batch(self, epoch: int, index: int) -> np.ndarray:
        """[<= batch_size] int64: dataset indices of batch `index` of `epoch`."""
        return self.order(epoch)[index * self.batch_size:(index + 1) * self.batch_size]


class PromptLoader:
    """Iterates one epoch of PromptBatches per `for` loop, from the saved position on.

    Args:
        dataset: the PromptDataset.
        batch_size: prompts per batch (data.train_batch_size).
        shuffle, seed: data.shuffle, data.seed.
        drop_last: drop the last partial batch (True for training, as verl; False for validation).
        pad_to: pad every batch to this width instead of its longest prompt (e.g. max_prompt_length).
    """

    def __init__(self, dataset: PromptDataset, batch_size: int, *, shuffle: bool = True, seed: int = 1,
                 drop_last: bool = True, pad_to: int | None = None):
        self.dataset = dataset
        if drop_last and len(dataset) < batch_size:  # an input problem: said as one, naming the files
            dropped = getattr(dataset, "num_filtered", 0)
            filtered = f" ({dropped} more were filtered as overlong)" if dropped else ""
            raise DataError(", ".join(getattr(dataset, "files", ["the dataset"])), f"{len(dataset)} prompts{filtered} do not fill one batch of "
                            f"{batch_size}", "lower data.train_batch_size (or data.gen_batch_size) or add prompts")
        self.sampler = EpochSampler(len(dataset), batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.pad_to = pad_to
        self.epoch = 0
        self._index = 0  # batches of `epoch` already handed out
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, permutation) cache

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[PromptBatch]:
        while self._index < len(self.sampler):
            if self._order is None or self._order[0] != self.epoch:
                self._order = (self.epoch, self.sampler.order(self.epoch))
            bs = self.sampler.batch_size
            indices = self._order[1][self._index * bs:(self._index + 1) * bs]
            # Count the batch as consumed before handing it out, so state_dict() taken while it is being used
            # resumes after it.
            self._index += 1
            yield self.dataset.collate(indices.tolist(), pad_to=self.pad_to)
        self.epoch, self._index = self.epoch + 1, 0

    def state_dict(self) -> dict:
        epoch, index = self.epoch, self._index
        if index >= len(self.sampler):  # the epoch is used up: resume at the start of the next
            epoch, index = epoch + 1, 0
        return {
            "epoch": epoch,
            "batch_index": index,
            "seed": self.sampler.seed,
            "shuffle": self.sampler.shuffle,
            "batch_size": self.sampler.batch_size,
            "num_items": self.sampler.num_items,
            "drop_last": self.sampler.drop_last,
        }

    def load_state_dict(self, state: dict) -> None:
        # The saved position only means the same prompts if the order it indexes is the same.
        for key in ("seed", "shuffle", "batch_size", "num_items", "drop_last"):
            ours = getattr(self.sampler, key)
            if key in state and state[key] != ours:
                raise ValueError(
                    f"the checkpoint's data loader had {key}={state[key]!r} but this run has {key}={ours!r}, so "
                    "resuming would not see the prompts the run would have seen; resume with the same data files, "
                    "data.seed, data.shuffle, data.train_batch_size and filtering, or start a new run"
                )
        epoch, index = int(state["epoch"]), int(state["batch_index"])
        if index >= len(self.sampler):
            epoch, index = epoch + 1, 0
        self.epoch, self._index = epoch, index
