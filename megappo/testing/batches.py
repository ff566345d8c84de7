"""Random `ModelBatch`es for the model-level tests: rows of different prompt and response lengths, deterministic."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from megappo.models.batch import ModelBatch, TrainInputs


def random_batch(seed: int, prompt_lens: Sequence[int], response_lens: Sequence[int], *,
                 old_log_prob: Optional[float] = None, values: bool = False, vocab: int = 400) -> ModelBatch:
    """Rows of random token ids in [1, vocab) (0 pads). With `old_log_prob`, training inputs drawn after the tokens
    from the same generator: old log-probs around it (+- 0.1), standard normal advantages and returns, and with
    `values` critic values (x 0.1)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in prompt_lens]
    responses = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in response_lens]
    b = ModelBatch.from_token_lists(prompts, responses, pad_token_id=0)
    return _with_train_inputs(b, g, old_log_prob, values)


def grouped_batch(seed: int, prompt_of_row: Sequence[int], prompt_lens: Sequence[int],
                  response_lens: Sequence[int], *, old_log_prob: Optional[float] = None, values: bool = False,
                  vocab: int = 400) -> ModelBatch:
    """Rows that share prompts (GRPO groups): row i's prompt is prompt `prompt_of_row[i]` of random tokens of
    `prompt_lens[...]`, its response random tokens of `response_lens[i]`; training inputs as `random_batch`."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in prompt_lens]
    responses = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in response_lens]
    b = ModelBatch.from_token_lists([prompts[k] for k in prompt_of_row], responses, pad_token_id=0)
    return _with_train_inputs(b, g, old_log_prob, values)


def _with_train_inputs(b: ModelBatch, g: torch.Generator, old_log_prob: Optional[float], values: bool) -> ModelBatch:
    """`b` with random training inputs drawn from `g` (none when old_log_prob is None)."""
    if old_log_prob is not None:
        shape = b.response_mask.shape
        b.train = TrainInputs(old_log_probs=old_log_prob + 0.1 * torch.randn(shape, generator=g),
                              advantages=torch.randn(shape, generator=g), returns=torch.randn(shape, generator=g),
                              values=0.1 * torch.randn(shape, generator=g) if values else None)
    return b
