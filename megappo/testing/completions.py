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
