"""Tiny, hub-free models and tokenizers for tests and benchmarks.

Nothing here downloads: tokenizers are trained with `tokenizers` on a built-in corpus and models are
`transformers` configs with random weights.
"""

from megappo.testing.tokenizer import make_tokenizer
from megappo.testing.hf_models import FAMILIES, make_hf_model, tiny_hf_config

__all__ = ["FAMILIES", "make_hf_model", "make_tokenizer", "tiny_hf_config"]
