"""The in-process engine's decoding loop: a forward batch that shrinks as its rows finish, over a KV cache that
grows in place.

A forward batch's cost is what its tokens cost: a row that has stopped leaves the batch at the step it stops (its
cache rows, position and mask row go with it, in one compaction of the cache per step at which some row stops); the
leading positions that are left padding in every row still decoding are cut from the cache at the same compaction,
and once no row has padding left the decode steps run without an attention mask. Needs transformers' cache-layer
API (`Cache(layers=...)`, `DynamicLayer`: transformers >= 4.56). The cache (`KVCache`) writes each step's keys
and values into a buffer that grows by doubling (amortised O(1) per token, at most twice the tokens held), and
hands the model views of it; the attention mask is a view of a buffer filled once. The per-step Python work is a
fixed number of tensor calls whatever the batch size, except sampling's one noise draw per live row from the row's
own generator (`sampling.sample_rows`), which keeps each row's draws those of its seed.

Every model forward (the prefill and each decode step) goes through the `forward(rows, new_mask, **model_kwargs)`
callable the engine passes (`HFEngine._forward`): rows [b] long are the indices (into the forward batch's rows) of
this forward's rows, new_mask [b, s] marks which of its s input positions are real tokens (the prefill's left
padding is 0).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer

from megappo.rollout.sampling import SamplingParams, sample_next, sample_rows

Forward = Callable[..., Any]  # forward(rows [b], new_mask [b, s], **model_kwargs) -> the model's output


class _GrowingLayer(DynamicLayer):
    """One layer's keys and values, [b, heads, capacity, head_dim] buffers of which the first `n` positions hold
    the sequence; `update` writes the new positions in place and returns views of [:, :, :n]."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit  # the most positions the layer will hold (prompt + max_new_tokens)
        self.n = 0
        self._k: Optional[torch.Tensor] = None
        self._v: Optional[torch.Tensor] = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def _reserve(self, new: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Room for `new` (keys, values [b, heads, s, head_dim]) after the n positions held: double the capacity."""
        need = self.n + new[0].shape[2]
        cap = 0 if self._k is None else self._k.shape[2]
        if need <= cap:
            return
        cap = min(max(need, 2 * cap), max(self.limit, need))
        for name, like in zip(("_k", "_v"), new):
            old = getattr(self, name)
            buf = like.new_empty((like.shape[0], like.shape[1], cap, like.shape[3]))
            if old is not None:
                buf[:, :, :self.n] = old[:, :, :self.n]
            setattr(self, name, buf)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        s = key_states.shape[2]
        self._reserve((key_states, value_states))
        self._k[:, :, self.n:self.n + s] = key_states
        self._v[:, :, self.n:self.n + s] = value_states
        self.n += s
        self.keys, self.values = self._k[:, :, :self.n], self._v[:, :, :self.n]
        return self.keys, self.values

    def keep(self, index: torch.Tensor, drop: int) -> None:
        """Keep the batch rows `index` [k] and the positions from `drop` on (into buffers of the same capacity)."""
        if self._k is None:
            return
        n = self.n - drop
        for name in ("_k", "_v"):
            old = getattr(self, name)
            buf = old.new_empty((index.numel(), old.shape[1], old.shape[2], old.shape[3]))
            buf[:, :, :n] = old[:, :, drop:self.n].index_select(0, index)
            setattr(self, name, buf)
        self.n = n
        self.keys, self.values = self._k[:, :, :n], self._v[:, :, :n]

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        # transformers 4.5x passes the query's cache_position tensor, 5.x its length
        q = query_length if isinstance(query_length, int) else int(query_length.shape[0])
        return self.n + q, 0

    def get_seq_length(self) -> int:
        return self.n

    def get_max_length(self) -> int:
        return -1


class KVCache(Cache):
    """A decoder's KV cache that grows in place and drops rows and leading positions (`keep`); a `transformers`
    `Cache`, passed as the model's cache argument. Full attention in every layer: a sliding-window layer sees the
    whole sequence and its mask limits what it attends to."""

    def __init__(self, num_layers: int, limit: int):
        super().__init__(layers=[_GrowingLayer(limit) for _ in range(num_layers)])

    def keep(self, index: torch.Tensor, drop: int = 0) -> None:
        for layer in self.layers:
            layer.keep(index, drop)


def num_cached_layers(model) -> int:
    """The number of decoder layers whose keys and values `model` caches (its text config's)."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if not kinds <= {"full_attention", "sliding_attention"}:
        raise NotImplementedError(f"{type(model).__name__} has {sorted(kinds)} layers; the in-process engine's KV "
                                  "cache holds full and sliding-window attention layers only")
    return int(config.num_hidden_layers)


class RowSampler:
    """The next token of each live row: greedy over the batch, else each row from its own generator (seeded with
    its sample's seed), its noise drawn as `torch.multinomial` draws it (`sampling.sample_rows`)."""

    def __init__(self, params: SamplingParams, seeds: Sequence[Optional[int]], device: torch.device):
        self.params = params
        self.gens = None if params.is_greedy else [torch.Generator(device).manual_seed(s) for s in seeds]

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [b, V] of the live rows -> (tokens [b] long, their log-probs [b] float32)."""
        if self.gens is None:
            return sample_next(logits, self.params)
        return sample_rows(logits, self.params, self.gens)

    def keep(self, index: list[int]) -> None:
        if self.gens is not None:
            self.gens = [self.gens[i] for i in index]


@dataclass
class Prefill:
    """A forward batch's left-padded prompts: ids and mask [B, P], positions [B, P] (or [3, B, P]: multimodal
    rotary), and the prefill's extra model inputs (a vision-language model's images)."""

    ids: torch.Tensor
    mask: torch.Tensor
    pos: torch.Tensor
    extra: dict


@dataclass
class Decoded:
    """Per row of the forward batch: its tokens, their log-probs, whether a stop token ended it; and whether an
    abort ended the loop."""

    tokens: list[list[int]]
    log_probs: list[list[float]]
    stopped: list[bool]
    aborted: bool


class _Live:
    """The rows still decoding: their indices, positions, attention-mask rows and left padding, compacted together."""

    def __init__(self, prefill: Prefill, width: int):
        b, p = prefill.ids.shape
        dev = prefill.ids.device
        self.rows = torch.arange(b, device=dev)
        self.pos = prefill.pos[..., -1:]
        self.pad = (prefill.mask == 0).sum(1)  # [b] left padding of each row
        self.mask = torch.ones((b, width), dtype=prefill.mask.dtype, device=dev)  # [b, width] prompt then new tokens
        self.mask[:, :p] = prefill.mask
        self.dropped = 0  # leading positions cut from the cache (padding of every live row)
        self.padded = bool((self.pad > 0).any())  # some live row has padding in the cache

    def keep(self, index: torch.Tensor) -> int:
        """Keep the rows `index` [k]; returns how many more leading positions their padding lets the cache drop."""
        self.rows, self.pos, self.pad = self.rows[index], self.pos.index_select(-2, index), self.pad[index]
        drop = int(self.pad.min()) - self.dropped
        self.mask = self.mask[index, drop:]
        self.dropped += drop
        self.padded = bool((self.pad > self.dropped).any())
        return drop

    def attention_mask(self, length: int) -> Optional[torch.Tensor]:
        """The mask of `length` cached-and-new positions; None when no live row has padding left."""
        return self.mask[:, :length] if self.padded else None


def decode(forward: Forward, prefill: Prefill, cache: KVCache, sampler: RowSampler, stop: torch.Tensor,
           max_new_tokens: int, abort: threading.Event) -> Decoded:
    """Sample up to `max_new_tokens` tokens for each row of `prefill`, each row until one of `stop` [k] ends it."""
    b, p = prefill.ids.shape
    dev = prefill.ids.device
    live = _Live(prefill, p + max_new_tokens)
    out = forward(live.rows, prefill.mask, input_ids=prefill.ids, attention_mask=live.attention_mask(p),
                  position_ids=prefill.pos, cache=cache, **prefill.extra)
    tok_out = torch.zeros((b, max_new_tokens), dtype=torch.long, device=dev)
    lp_out = torch.zeros((b, max_new_tokens), dtype=torch.float32, device=dev)
    length = torch.zeros(b, dtype=torch.long, device=dev)
    stopped = torch.zeros(b, dtype=torch.bool, device=dev)
    aborted = False
    ones = torch.ones((b, 1), dtype=prefill.mask.dtype, device=dev)
    for t in range(max_new_tokens):
        if abort.is_set():
            aborted = True
            break
        tok, logp = sampler(out.logits[:, -1])
        tok_out[live.rows, t], lp_out[live.rows, t] = tok, logp
        length[live.rows] = t + 1
        ended = torch.isin(tok, stop)
        if t + 1 == max_new_tokens:
            stopped[live.rows] = ended
            break
        if bool(ended.any()):
            stopped[live.rows[ended]] = True
            index = (~ended).nonzero().flatten()
            if index.numel() == 0:
                break
            sampler.keep(index.tolist())
            cache.keep(index, live.keep(index))
            tok = tok[index]
        live.pos = live.pos + 1
        k = live.rows.numel()
        out = forward(live.rows, ones[:k], input_ids=tok.unsqueeze(1), position_ids=live.pos, cache=cache,
                      attention_mask=live.attention_mask(p + t + 1 - live.dropped))
    lengths = length.tolist()
    return Decoded(tokens=[r[:n] for r, n in zip(tok_out.tolist(), lengths)],
                   log_probs=[r[:n] for r, n in zip(lp_out.tolist(), lengths)],
                   stopped=stopped.tolist(), aborted=aborted)
