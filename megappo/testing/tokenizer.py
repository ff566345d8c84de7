"""A small byte-level BPE tokenizer with a Qwen-style chat template, trained locally in about a second."""
from __future__ import annotations

import os
import random

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_WORDS = (
    "the a an of to and in is was for on that with as by at it from this be are or which has had not but "
    "janet ducks eggs day breakfast muffins friends sells market dollar dollars each how many much does make "
    "every per total cost price bought sold left more less than twice half times minutes hours week weeks "
    "answer think step by step output final after let's number numbers add subtract multiply divide equals "
    "apples oranges books pages students class school money bag bags boxes miles car train speed water"
).split()


def _corpus(n_lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        # Digits, thousands separators and '####' occur in GSM8K answers; the tokenizer must round-trip them.
        words.insert(rng.randrange(len(words)), f"{rng.randint(0, 99999):,}")
        words.append(f"#### {rng.randint(0, 5000)}")
        lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", " $18."]))
    return lines


def make_tokenizer(out_dir: str | None = None, vocab_size: int = 512, seed: int = 0):
    """Train a byte-level BPE tokenizer and return it as a `transformers.PreTrainedTokenizerFast`.

    With `out_dir`, the tokenizer files (tokenizer.json, tokenizer_config.json, special tokens) are saved there so
    `AutoTokenizer.from_pretrained(out_dir)` loads it. `vocab_size` includes the special tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(2000, seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
        fast.save_pretrained(out_dir)
    return fast


def make_chat_tokenizer(family: str = "qwen2.5"):
    """A byte-level tokenizer (every byte one token, no merges: built at once) carrying a real model family's chat
    template and special and added tokens (megappo.testing.chat_templates.CHAT_FAMILIES): what multi-turn
    rendering is tested against."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    from megappo.testing.chat_templates import CHAT_FAMILIES

    template, special, added = CHAT_FAMILIES[family]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {w: i for i, w in enumerate(alphabet)}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], eos_token="<|im_end|>", pad_token="<|endoftext|>",
                         unk_token=None, bos_token=None, model_max_length=1 << 20)
    tok.add_special_tokens({"additional_special_tokens": [s for s in special if s not in tok.all_special_tokens]})
    tok.add_tokens(added)
    tok.chat_template = template
    return tok
