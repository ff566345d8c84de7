"""The in-process rollout engine against `transformers` itself: greedy tokens, batching, stop tokens, seeds, n,
and weight updates (by checkpoint name, fused MoE experts included) against a model loaded from the same files."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megappo.rollout import HFEngine, SamplingParams
from megappo.testing.completions import tokens

torch.set_num_threads(1)
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [3]]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0)


def _hf_greedy(hf_dir, prompt, n):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_greedy_batch_equals_transformers_per_prompt(hf_model_dir, family):
    hf_dir = hf_model_dir(family)
    engine = HFEngine(hf_dir, max_num_seqs=2)  # two forward batches, mixed prompt lengths in each
    result = engine.generate(PROMPTS, GREEDY)
    for prompt, (c,) in zip(PROMPTS, result):
        assert c.output_ids == _hf_greedy(hf_dir, prompt, 8)[: len(c.output_ids)]
        assert len(c.log_probs) == len(c.output_ids) and all(lp <= 0 for lp in c.log_probs)
    alone = engine.generate([PROMPTS[1]], GREEDY)[0][0]
    assert alone.output_ids == result[1][0].output_ids
    assert max(abs(a - b) for a, b in zip(alone.log_probs, result[1][0].log_probs)) < 1e-5


def test_stop_tokens_seeds_and_n(hf_model_dir):
    engine = HFEngine(hf_model_dir("llama"))
    first = engine.generate(PROMPTS[:1], GREEDY)[0][0]
    stop = first.output_ids[2]
    cut = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=8, temperature=0, stop_token_ids=(stop,)))[0][0]
    assert cut.output_ids == first.output_ids[: first.output_ids.index(stop) + 1] and cut.finish_reason == "stop"
    assert first.finish_reason == "length" or first.output_ids[-1] in engine.eos_ids
    sampled = SamplingParams(max_new_tokens=6, temperature=1.0, n=3, seed=7)
    a, b = engine.generate(PROMPTS, sampled), engine.generate(PROMPTS, sampled)
    assert [len(g) for g in a] == [3, 3, 3] and all(c.prompt_index == i for i, g in enumerate(a) for c in g)
    assert [[c.output_ids for c in g] for g in a] == [[c.output_ids for c in g] for g in b]
    other = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=1.0, n=3, seed=8))
    assert [[c.output_ids for c in g] for g in a] != [[c.output_ids for c in g] for g in other]


@pytest.mark.parametrize("family", ["qwen2", "mixtral"])
def test_weight_update_equals_a_fresh_engine_on_the_new_weights(tmp_path, family):
    from megappo.testing.hf_models import make_hf_model

    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    make_hf_model(family, old, seed=0)
    make_hf_model(family, new, seed=1)
    engine = HFEngine(old)
    before = engine.generate(PROMPTS, GREEDY)
    assert engine.update_weights_from_disk(new) == 1 and engine.weight_version == 1
    got, want = engine.generate(PROMPTS, GREEDY), HFEngine(new).generate(PROMPTS, GREEDY)
    assert [g[0].output_ids for g in got] == [w[0].output_ids for w in want] != [b[0].output_ids for b in before]
    for g, w in zip(got, want):
        assert max(abs(a - b) for a, b in zip(g[0].log_probs, w[0].log_probs)) < 1e-5
        assert g[0].weight_version == 1


def test_bad_weight_updates_fail_clearly(hf_model_dir):
    engine = HFEngine(hf_model_dir("qwen3_moe"))
    embed = engine.model.get_input_embeddings().weight
    with pytest.raises(KeyError, match="no parameter"):
        engine.update_weights([("model.layers.0.mlp.nonexistent.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="does not fit"):
        engine.update_weights([("model.embed_tokens.weight", torch.zeros(3, 3))])
    with pytest.raises(ValueError, match="left .* parameters unset"):
        engine.update_weights([("model.embed_tokens.weight", torch.zeros_like(embed))])
    with pytest.raises(ValueError, match="left .* parameters unset"):  # one expert of a fused parameter is not all
        engine.update_weights([("model.layers.0.mlp.experts.0.down_proj.weight",
                                engine.model.model.layers[0].mlp.experts.down_proj[0].clone())], complete=True)
    with pytest.raises(FileNotFoundError, match="config.json"):
        HFEngine("/nonexistent")


def test_a_sample_depends_on_its_seed_prompt_index_and_sample_index_not_on_its_batch(hf_model_dir):
    """Sample j of the batch's prompt i is drawn with its own seed (`sample_seed`): a data-parallel share of the
    batch (`prompt_offset`), other batch mates, another forward-batch size or another engine (rank) draw the same
    tokens for it."""
    hf_dir = hf_model_dir("qwen2")
    sampled = SamplingParams(max_new_tokens=6, temperature=1.0, n=3, seed=7, ignore_eos=True)
    whole = HFEngine(hf_dir).generate(PROMPTS, sampled)
    assert len({tuple(t) for g in tokens(whole) for t in g}) > 3  # it does sample (not all rows alike)
    # the two shares of a two-rank split, each on an engine of its own, with other forward-batch sizes
    first = HFEngine(hf_dir, max_num_seqs=2).generate(PROMPTS[:1], sampled, prompt_offset=0)
    rest = HFEngine(hf_dir, max_num_seqs=4).generate(PROMPTS[1:], sampled, prompt_offset=1)
    assert tokens(first + rest) == tokens(whole)
    for got, want in zip(first + rest, whole):
        for a, b in zip(got, want):
            assert max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs)) < 1e-5
    # other batch mates (a longer prompt pads the batch differently) at the same index: the same samples
    mates = HFEngine(hf_dir).generate([[4, 4, 4, 4, 4, 4, 4, 4, 4], PROMPTS[1]], sampled)
    assert tokens(mates)[1] == tokens(whole)[1]
    # another index (or seed) is another draw
    moved = HFEngine(hf_dir).generate([PROMPTS[1]], sampled, prompt_offset=2)
    assert tokens(moved)[0] != tokens(whole)[1]
    # without a seed the engine's stream seeds the request: engines built alike sample alike, request by request
    unseeded = replace(sampled, seed=None)
    a, b = HFEngine(hf_dir, seed=3), HFEngine(hf_dir, seed=3)
    assert [tokens(a.generate(PROMPTS, unseeded)) for _ in range(2)] == \
        [tokens(b.generate(PROMPTS, unseeded)) for _ in range(2)]


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_released_weights_are_freed_and_a_complete_update_restores_them_exactly(hf_model_dir, family):
    """rollout.free_cache_engine: the hybrid engine's parameters hold no memory between its rollout and the next
    sync, generating then fails clearly, a partial sync cannot refill them, and the complete sync gives the same
    tokens and log-probs as before the release."""
    from megappo.convert.hf_io import HFCheckpoint

    hf_dir = hf_model_dir(family)
    engine = HFEngine(hf_dir)
    before = engine.generate(PROMPTS, GREEDY)
    ckpt = HFCheckpoint.open(hf_dir)
    tensors = [(n, ckpt.read(n).clone()) for n in ckpt.files]
    ckpt.close()
    assert engine.release_weights() and engine.release_weights()  # idempotent
    assert sum(p.untyped_storage().nbytes() for p in engine.model.parameters()) == 0
    with pytest.raises(RuntimeError, match="released"):
        engine.generate(PROMPTS, GREEDY)
    with pytest.raises(ValueError, match="partial weight update"):
        engine.load_weights([tensors[:1]], version=1, partial=True)
    with pytest.raises(RuntimeError, match="released"):
        engine.prompt_log_probs([5, 6, 7])
    assert engine.load_weights([tensors], version=1) == 1
    after = engine.generate(PROMPTS, GREEDY)
    assert tokens(after) == tokens(before)
    assert [c.log_probs for g in after for c in g] == [c.log_probs for g in before for c in g]
