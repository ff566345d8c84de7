"""The in-process engine's decoding loop (`megappo/rollout/hf/decode.py`) against a plain loop that recomputes each
row alone from its full sequence (no cache, no padding, no batch mates) and samples it with `sample_next` and the
row's own generator, as the engine's loop before the shrinking batch did: the same tokens and log-probs, rows that
finish leave the forward batch, abort returns what it has; the cache and the batched sampler on their own."""
from __future__ import annotations

import pytest
import torch

from megappo.rollout import HFEngine, SamplingParams
from megappo.rollout.hf.decode import KVCache
from megappo.rollout.sampling import sample_next, sample_rows
from megappo.rollout.seeds import row_seeds

torch.set_num_threads(1)
# prompt lengths 3, 8, 1, 5: left padding differs row by row; the 8-token row (no padding) stops first under
# STOPS, so the rows left have padding the cache can drop
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16], [3], [20, 21, 22, 23, 24]]
STOPS = (368, 283, 374)  # the tiny qwen2's greedy tokens: rows end after 8, 1, 12 (max) and 6 tokens
GREEDY = SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=STOPS)
# a seventh of the vocabulary stops a row: sampled rows end at many lengths
SAMPLED = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.95, top_k=200, n=3, seed=11,
                         stop_token_ids=tuple(range(0, 512, 7)))


@torch.no_grad()
def _reference(model, prompt: list[int], params: SamplingParams, seed, stops: set[int]):
    """One row alone, each token from a forward of its whole sequence: (tokens, log-probs)."""
    gen = None if params.is_greedy else torch.Generator().manual_seed(seed)
    ids, toks, lps = list(prompt), [], []
    for _ in range(params.max_new_tokens):
        tok, lp = sample_next(model(torch.tensor([ids])).logits[:, -1], params, gen)
        toks.append(int(tok))
        lps.append(float(lp))
        ids.append(int(tok))
        if toks[-1] in stops:
            break
    return toks, lps


def _batch_sizes(engine, run) -> list[int]:
    """The batch size of each model forward during `run()` (a forward pre-hook), and what run() returns."""
    sizes: list[int] = []
    hook = engine.model.register_forward_pre_hook(lambda m, a, kw: sizes.append(kw["input_ids"].shape[0]),
                                                  with_kwargs=True)
    try:
        return sizes, run()
    finally:
        hook.remove()


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_batch_of_mixed_lengths_equals_each_row_alone_and_rows_leave_the_batch(hf_model_dir, params):
    engine = HFEngine(hf_model_dir("qwen2"))
    sizes, groups = _batch_sizes(engine, lambda: engine.generate(PROMPTS, params))
    got = [c for g in groups for c in g]
    stops = set(params.stop_token_ids) | engine.eos_ids
    seeds = row_seeds(params.seed, len(PROMPTS), params.n)
    rows = [p for p in PROMPTS for _ in range(params.n)]
    lengths = [len(c.output_ids) for c in got]
    assert len(set(lengths)) >= 3 and min(lengths) < params.max_new_tokens == max(lengths)
    for c, prompt, seed in zip(got, rows, seeds):
        toks, lps = _reference(engine.model, prompt, params, seed, stops)
        assert c.output_ids == toks
        assert max(abs(a - b) for a, b in zip(c.log_probs, lps)) <= 1e-5
        assert c.finish_reason == ("stop" if toks[-1] in stops else "length")
    # each row is in the forwards that make its tokens and no other: the prefill, then one forward per token
    # after the first, the batch shrinking as rows stop
    assert sizes[0] == len(rows) and sizes[1:] == sorted(sizes[1:], reverse=True)
    assert sum(sizes[1:]) == sum(n - 1 for n in lengths)


def test_edges_one_token_prompts_one_new_token_and_every_row_stopping_at_once(hf_model_dir):
    engine = HFEngine(hf_model_dir("qwen2"), max_num_seqs=3)  # two forward batches
    one = engine.generate(PROMPTS, SamplingParams(max_new_tokens=1, temperature=0))
    assert [len(g[0].output_ids) for g in one] == [1] * 4
    first = [g[0].output_ids[0] for g in one]
    every = engine.generate(PROMPTS, SamplingParams(max_new_tokens=5, temperature=0, stop_token_ids=tuple(first)))
    assert [(g[0].output_ids, g[0].finish_reason) for g in every] == [([t], "stop") for t in first]
    alone = engine.generate([[3]], SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))[0][0]
    ref, _ = _reference(engine.model, [3], GREEDY, None, set())
    assert alone.output_ids == ref and alone.finish_reason == "length"


def test_abort_mid_generation_returns_the_tokens_each_row_has(hf_model_dir):
    engine = HFEngine(hf_model_dir("qwen2"), max_num_seqs=4)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5, n=2, ignore_eos=True)
    full = [c for g in engine.generate(PROMPTS, params) for c in g]
    calls = []

    def abort_at_four(module, args, kwargs):
        calls.append(1)
        if len(calls) == 4:  # during the third decode step: three tokens sampled, the step's logits are not
            engine.abort()

    engine.model.register_forward_pre_hook(abort_at_four, with_kwargs=True)
    got = [c for g in engine.generate(PROMPTS, params) for c in g]
    first, rest = got[:4], got[4:]  # the first forward batch, and the batch not started
    assert all(c.finish_reason == "abort" for c in got)
    assert [len(c.output_ids) for c in first] == [3] * 4 and all(c.output_ids == [] for c in rest)
    for c, f in zip(first, full):
        assert c.output_ids == f.output_ids[:3] and c.log_probs == pytest.approx(f.log_probs[:3], abs=1e-6)
    assert len(engine.generate(PROMPTS[:1], params)[0][0].output_ids) == 12  # the next request starts afresh


def test_kv_cache_grows_in_place_and_keeps_rows_and_trailing_positions():
    cache = KVCache(num_layers=2, limit=8)
    steps = [torch.randn(3, 2, 3, 4)] + [torch.randn(3, 2, 1, 4) for _ in range(4)]
    for x in steps:
        for layer in range(2):
            keys, values = cache.update(x, -x, layer)
    whole = torch.cat(steps, 2)
    assert torch.equal(keys, whole) and torch.equal(values, -whole) and cache.get_seq_length() == 7
    assert cache.layers[0]._k.shape[2] == 8  # grown by doubling to its limit, not one position at a time
    assert cache.get_mask_sizes(1, 0) == (8, 0)
    cache.keep(torch.tensor([2, 0]), drop=2)
    assert torch.equal(cache.layers[1].keys, whole[[2, 0], :, 2:]) and cache.get_seq_length() == 5
    x = torch.randn(2, 2, 1, 4)
    keys, _ = cache.update(x, x, 0)
    assert torch.equal(keys, torch.cat([whole[[2, 0], :, 2:], x], 2))


@pytest.mark.parametrize("top", [dict(), dict(top_k=5), dict(top_p=0.7)], ids=["plain", "top_k", "top_p"])
def test_batched_row_sampling_draws_what_each_rows_multinomial_draws(top):
    params = SamplingParams(max_new_tokens=1, temperature=0.7, **top)
    logits = torch.randn(6, 50) * 3
    gens = [torch.Generator().manual_seed(s) for s in range(6)]
    ref_gens = [torch.Generator().manual_seed(s) for s in range(6)]
    for _ in range(3):  # the generators stay in step draw after draw
        tok, lp = sample_rows(logits, params, gens)
        want = [sample_next(logits[r:r + 1], params, g) for r, g in enumerate(ref_gens)]
        assert tok.tolist() == [int(t) for t, _ in want]
        assert torch.equal(lp, torch.cat([w for _, w in want]))
