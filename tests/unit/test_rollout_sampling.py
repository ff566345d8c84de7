"""The next-token sampler: greedy, temperature, top-k, top-p, and the log-probs it reports."""
from __future__ import annotations

from dataclasses import replace

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


@pytest.mark.parametrize("bad", ["data.max_response_length=0", "actor_rollout_ref.rollout.top_p=0.0",
                                 "actor_rollout_ref.rollout.temperature=-1.0", "actor_rollout_ref.rollout.n=0"])
def test_invalid_parameters_are_refused(bad):
    from megappo.checks import validate
    from megappo.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=bad.split("=")[0].replace(".", r"\.")):
        validate(load_config(None, [bad]))


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
    from megappo.trainer import settings

    cfg = resolve(load_config(None, ["actor_rollout_ref.rollout.temperature=0.7", "actor_rollout_ref.rollout.top_k=5",
                                     "actor_rollout_ref.rollout.n=3", "data.max_response_length=12"]))
    p = settings.sampling(cfg, seed=4)
    assert (p.temperature, p.top_k, p.n, p.max_new_tokens, p.seed, p.is_greedy) == (0.7, 5, 3, 12, 4, False)
    v = settings.sampling(cfg, validate=True)
    assert v.is_greedy and v.n == 1 and v.logprob_temperature == 1.0


# -- per-sample seeds --------------------------------------------------------------------------------------------
def test_a_sample_seed_follows_the_prompt_index_and_sample_index_not_the_request():
    from megappo.rollout.seeds import row_seeds, sample_seed

    # rows grouped by prompt: row k is sample k % n of prompt k // n; all distinct, int64 (SGLang's sampling_seed)
    assert row_seeds(100, 2, 3) == [sample_seed(100, i, j, 3) for i in range(2) for j in range(3)]
    assert all(0 <= s < 2 ** 63 for s in row_seeds(100, 2, 3))
    # consecutive steps (step seeds 7919 apart) share no sample seed even with many samples per step
    from megappo.trainer.rollout import step_seed
    a, b = row_seeds(step_seed(1, 1), 5000, 4), row_seeds(step_seed(1, 2), 5000, 4)
    assert len(set(a) | set(b)) == len(a) + len(b)
    assert row_seeds(None, 2, 3) == [None] * 6
    whole = row_seeds(7, 10, 4)
    assert len(set(whole)) == len(whole)
    # any contiguous split of the batch (data-parallel shares, requests) gives every sample its whole-batch seed
    for cuts in ([0, 5, 10], [0, 3, 4, 10], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]):
        assert sum((row_seeds(7, b - a, 4, prompt_offset=a) for a, b in zip(cuts, cuts[1:])), []) == whole


def _fake_sglang(monkeypatch) -> list:
    """SGLang's /generate answered in-process: each row's output is its sampling seed; the requests are recorded."""
    from megappo.rollout.sglang import engine as sglang_engine

    requests: list = []

    def http_json(url, body, timeout=None, api_key=None):
        requests.append((url, body))
        one = not isinstance(body["sampling_params"], list)
        params = [body["sampling_params"]] if one else body["sampling_params"]
        rows = [{"output_ids": [p.get("sampling_seed", -1)],
                 "meta_info": {"finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.5, 0, None]]}}
                for p in params]
        return rows[0] if one else rows

    monkeypatch.setattr(sglang_engine, "http_json", http_json)
    return requests


def _seeds(groups) -> list[list[int]]:
    return [[c.output_ids[0] for c in g] for g in groups]


def test_sglang_engines_send_each_row_its_sample_seed(monkeypatch):
    from megappo.rollout.seeds import row_seeds
    from megappo.rollout.sglang.engine import SGLangEngine
    from megappo.rollout.sglang.fleet import SGLangFleet

    requests = _fake_sglang(monkeypatch)
    prompts = [[5, 6], [7], [8, 9, 10], [11]]
    params = SamplingParams(max_new_tokens=1, n=2, seed=40)
    want = [row_seeds(40, 4, 2)[2 * i:2 * i + 2] for i in range(4)]
    assert _seeds(SGLangEngine("http://a").generate(prompts, params)) == want
    # a data-parallel share: the batch's prompts 1.. keep their seeds
    assert _seeds(SGLangEngine("http://a").generate(prompts[1:], params, prompt_offset=1)) == want[1:]
    # a fleet spreads the rows over its servers (and a router takes one row per request): the same seeds
    requests.clear()
    assert _seeds(SGLangFleet(["http://a", "http://b"]).generate(prompts[2:], params, prompt_offset=2)) == want[2:]
    assert {url for url, _ in requests} == {"http://a/generate", "http://b/generate"}
    routed = SGLangFleet(["http://a"], router_url="http://r").generate(prompts[1:], params, prompt_offset=1)
    assert _seeds(routed) == want[1:]
    # no seed: no sampling_seed (the server's own stream)
    requests.clear()
    SGLangEngine("http://a").generate(prompts, replace(params, seed=None))
    assert not any("sampling_seed" in p for _, body in requests for p in body["sampling_params"])
