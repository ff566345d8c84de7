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
