"""Per-sample sampling seeds: what a sample draws depends on the step's seed and on which sample it is, not on the
request, batch, server or data-parallel rank that draws it.

Sample `j` (of `n`) of the step batch's prompt `i` is drawn with seed `sample_seed(seed, i, j, n)` (a hash of the seed and
the sample's row i * n + j when the whole batch is one request) by every engine: the in-process engine (`HFEngine`) seeds that
row's own generator with it, an SGLang server gets it as the row's `sampling_seed` (`SGLangEngine`, `SGLangFleet`,
which keeps a row's seed when it retries the row on another server). A request that holds prompts `i0, i0 + 1, ...`
of the batch (a data-parallel rank's share) says so with `prompt_offset=i0`, so splitting a batch over ranks, servers
or forward batches samples what one request for the whole batch would (the in-process engine up to float summation
order in its forward pass; an SGLang server only with `--enable-deterministic-inference`).
"""
from __future__ import annotations

from typing import Optional


_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: every input bit moves about half the output bits."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


def sample_seed(seed: int, prompt_index: int, sample_index: int, n: int) -> int:
    """The seed of sample `sample_index` (of `n`) of the batch's prompt `prompt_index`, in a request seeded `seed`:
    a hash in [0, 2**63) (SGLang's `sampling_seed` is an int64). A hash, not `seed + row`: consecutive steps' seeds
    are a few thousand apart (`step_seed`), so rows of a large step would reuse the next step's streams."""
    row = prompt_index * n + sample_index
    return _mix(_mix(seed & _MASK) ^ row) >> 1


def row_seeds(seed: Optional[int], num_prompts: int, n: int, prompt_offset: int = 0) -> list[Optional[int]]:
    """The seed of each row of a request of `num_prompts` prompts (the batch's prompts `prompt_offset`, ...) with `n`
    samples each, rows grouped by prompt (row k: sample k % n of prompt k // n). All None without a seed."""
    return [None if seed is None else sample_seed(seed, prompt_offset + i, j, n)
            for i in range(num_prompts) for j in range(n)]


def request_seeds(params, num_prompts: int, prompt_offset: int = 0, seed: Optional[int] = None) -> list[Optional[int]]:
    """The seed of each row of a request (`row_seeds`), or the request's own `params.row_seeds` (one per prompt,
    n = 1) when it gives them. seed: the request seed to use in place of `params.seed` (an engine that drew one)."""
    if params.row_seeds is not None:
        if params.n != 1 or len(params.row_seeds) != num_prompts:
            raise ValueError(f"SamplingParams.row_seeds: {len(params.row_seeds)} seeds for {num_prompts} prompts with "
                             f"n={params.n}; give one seed per prompt and n=1")
        return list(params.row_seeds)
    return row_seeds(params.seed if seed is None else seed, num_prompts, params.n, prompt_offset)
