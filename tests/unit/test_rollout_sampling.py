"""The next-token sampler: greedy, temperature, top-k, top-p, and the log-probs it reports."""
from __future__ import annotations

import pytest
import torch

from megappo.rollout.sampling import SamplingParams, sample_next

torch.set_num_threads(1)


def _draws(logits, params, n=400):
    g = torch.Generator().manual_seed(0)
    return torch.stack([sample_next(logits, params, g)[0] for _ in range(n)])


def test_greedy_takes_the_argmax_and_reports_its_log_prob():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.5]])
    tok, logp = sample_next(logits, SamplingParams(max_new_tokens=1, temperature=0))
    assert tok.tolist() == [1, 0]
    torch.testing.assert_close(logp, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])
    assert SamplingParams(max_new_tokens=1, top_k=1).is_greedy and SamplingParams(max_new_tokens=1, greedy=True).is_greedy


def test_log_probs_are_those_of_the_tempered_distribution_before_filtering():
    logits = torch.randn(4, 11, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(max_new_tokens=1, temperature=0.7, top_k=3, top_p=0.9)
    tok, logp = sample_next(logits, params, torch.Generator().manual_seed(2))
    want = torch.log_softmax(logits / 0.7, -1).gather(-1, tok[:, None])[:, 0]
    torch.testing.assert_close(logp, want)


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[3.0, 2.5, 2.0, 0.0, -1.0]])
    assert set(_draws(logits, SamplingParams(max_new_tokens=1, top_k=2)).flatten().tolist()) == {0, 1}
    # p(0) = 0.48, p(0) + p(1) = 0.77: top_p 0.5 keeps tokens 0 and 1 (the smallest set reaching 0.5)
    assert set(_draws(logits, SamplingParams(max_new_tokens=1, top_p=0.5)).flatten().tolist()) == {0, 1}
    assert set(_draws(logits, SamplingParams(max_new_tokens=1, top_p=0.4)).flatten().tolist()) == {0}
    assert set(_draws(logits, SamplingParams(max_new_tokens=1)).flatten().tolist()) == {0, 1, 2, 3, 4}


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([[1.0, 0.0]])
    cold = _draws(logits, SamplingParams(max_new_tokens=1, temperature=0.2)).float().mean().item()
    hot = _draws(logits, SamplingParams(max_new_tokens=1, temperature=5.0)).float().mean().item()
    assert cold < 0.05 < 0.35 < hot  # share of token 1: ~0.007 cold, ~0.45 hot


@pytest.mark.parametrize("bad", [dict(max_new_tokens=0), dict(max_new_tokens=4, top_p=0.0),
                                 dict(max_new_tokens=4, temperature=-1.0), dict(max_new_tokens=4, n=0)])
def test_invalid_parameters_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_which_distribution_a_log_prob_is_under_is_decided_once():
    # greedy (temperature 0, top_k 1, greedy=True): the untempered distribution; otherwise softmax(logits / T)
    assert SamplingParams(max_new_tokens=1, temperature=0).logprob_temperature == 1.0
    assert SamplingParams(max_new_tokens=1, temperature=0.5, top_k=1).logprob_temperature == 1.0
    assert SamplingParams(max_new_tokens=1, temperature=0.5, greedy=True).logprob_temperature == 1.0
    assert SamplingParams(max_new_tokens=1, temperature=0.5, top_k=4).logprob_temperature == 0.5
    logits = torch.randn(3, 9, generator=torch.Generator().manual_seed(3))
    for params in (SamplingParams(max_new_tokens=1, temperature=0.6), SamplingParams(max_new_tokens=1, greedy=True)):
        tok, logp = sample_next(logits, params, torch.Generator().manual_seed(0))
        want = torch.log_softmax(logits / params.logprob_temperature, -1).gather(-1, tok[:, None])[:, 0]
        torch.testing.assert_close(logp, want)


def test_sampling_params_from_the_rollout_config():
    from megappo.config import load_config, resolve

    cfg = resolve(load_config(None, ["actor_rollout_ref.rollout.temperature=0.7", "actor_rollout_ref.rollout.top_k=5",
                                     "actor_rollout_ref.rollout.n=3", "data.max_response_length=12"]))
    p = SamplingParams.from_rollout_config(cfg.actor_rollout_ref.rollout, seed=4)
    assert (p.temperature, p.top_k, p.n, p.max_new_tokens, p.seed, p.is_greedy) == (0.7, 5, 3, 12, 4, False)
    v = SamplingParams.from_rollout_config(cfg.actor_rollout_ref.rollout, validate=True)
    assert v.is_greedy and v.n == 1 and v.logprob_temperature == 1.0
