"""Comparing two engines' answers (`generate`: per prompt, a list of `Completion`s) in the rollout tests."""
from __future__ import annotations


def tokens(groups) -> list[list[list[int]]]:
    """Each completion's token ids, grouped as `generate` answers."""
    return [[c.output_ids for c in g] for g in groups]


def assert_same_completions(got, want, tol: float = 1e-4) -> None:
    """The same tokens, and log-probs within `tol` of each other."""
    assert tokens(got) == tokens(want)
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            assert max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs)) < tol


def assert_continued_on_new_weights(prompts, partial, groups, old: str, new: str, budget: int, versions) -> None:
    """A greedy partial rollout that continued across a weight sync: `partial` (the aborted answer: each sample's
    tokens so far) and `groups` (the finished one) for `prompts`, the weights changing from HF directory `old` to
    `new`, `versions` = (the version before, after). Each sample kept its tokens, went on to `budget` tokens on the
    new weights (what the in-process engine on `new` generates after them, told apart from what `old` would have),
    and carries its first token's version."""
    from megappo.rollout import HFEngine, SamplingParams

    greedy = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    checked = 0
    for prompt, before, group in zip(prompts, partial, groups):
        for b, c in zip(before, group):
            assert c.output_ids[:len(b.output_ids)] == b.output_ids  # continued from its tokens
            assert len(c.output_ids) == len(c.log_probs) == budget and c.finish_reason == "length"
            assert c.extra["partial"] == bool(b.output_ids)
            assert c.weight_version == (versions[0] if b.output_ids else versions[1])
            if b.output_ids:
                start = prompt + b.output_ids
                tail = c.output_ids[len(b.output_ids):][:8]
                assert tail == HFEngine(new).generate([start], greedy)[0][0].output_ids  # the new weights'
                checked += tail != HFEngine(old).generate([start], greedy)[0][0].output_ids
    assert checked  # the old weights would have gone on otherwise: the check above tells them apart


def assert_scored_alike(groups, model_dir: str, prompts, tol: float, multi_modal=None) -> None:
    """Each completion's log-probs (softmax at T = 1: greedy, or sampled at temperature 1) within `tol` of
    transformers' log-probs of the same tokens after the same prompt (teacher forcing: robust where two engines'
    greedy tokens part at a near-tie). groups: `generate`'s answer, as Completions or their dicts."""
    from megappo.rollout.hf.engine import HFEngine

    engine = HFEngine(model_dir)
    for k, (prompt, group) in enumerate(zip(prompts, groups)):
        kwargs = {"multi_modal": multi_modal[k]} if multi_modal is not None else {}
        for c in group:
            ids, logprobs = (c["output_ids"], c["log_probs"]) if isinstance(c, dict) else (c.output_ids, c.log_probs)
            want = engine.prompt_log_probs(list(prompt) + list(ids), **kwargs)[0][len(prompt) - 1:]
            assert len(want) == len(logprobs) and max(abs(a - b) for a, b in zip(logprobs, want)) < tol


def partial_rollout_across_sync(engine, prompts, budget: int, wait_s: float, sync) -> tuple[list, list]:
    """A greedy generation of `budget` tokens, 2 samples a prompt, through the async producer as the trainer has it,
    cut by a weight sync after `wait_s` seconds (some tokens in, far from the end): the producer's pause aborts it
    and the engine answers with each sample's tokens; `sync()` changes the weights; after the resume every sample
    continues. Returns (the aborted answer, the finished one)."""
    import time

    from megappo.rollout import SamplingParams
    from megappo.trainer.async_rollout import Producer, _Job

    producer = Producer(engine, partial=True)
    try:
        job = _Job(prompts, SamplingParams(max_new_tokens=budget, temperature=0, ignore_eos=True, n=2), 0)
        future = producer.put(job)
        while not job.started:
            time.sleep(0.01)
        time.sleep(wait_s)
        producer.pause()  # the sync: aborts, returns once the engine is idle
        partial = job.done
        assert partial is not None and not future.done()
        assert all(c.finish_reason == "abort" and len(c.output_ids) < budget for g in partial for c in g)
        assert any(c.output_ids for g in partial for c in g)
        sync()
        producer.resume()
        groups = future.result(timeout=300)
    finally:
        producer.close()
    assert [len(g) for g in groups] == [2] * len(prompts)
    return partial, groups
