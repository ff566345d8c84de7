"""megappo's vLLM requests and the parsing of vLLM's answers (megappo/rollout/vllm/requests.py), without vLLM: the
fields each request carries (one sample per request with its own seed), and completions, versions, routes and
prompt log-probs read back. tests/e2e/test_vllm_protocol.py checks the same against vLLM's own protocol classes."""
from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from megappo.rollout.routes import RouteLayout
from megappo.rollout.sampling import SamplingParams
from megappo.rollout.seeds import request_seeds, sample_seed
from megappo.rollout.vllm.requests import (completion_request, max_lora_rank, model_eos_ids, parse_choice,
                                           parse_prompt_logprobs, prompt_logprobs_request, sampling_fields,
                                           versions_of)


def test_a_request_is_one_sample_with_its_own_seed():
    params = SamplingParams(max_new_tokens=7, temperature=0.8, top_p=0.9, top_k=5, n=3, seed=11,
                            stop_token_ids=(2, 3))
    body = completion_request([5, 6, 7], params, 123, request_id="r1")
    assert body["prompt"] == [5, 6, 7] and body["n"] == 1 and body["seed"] == 123
    assert body["max_tokens"] == 7 and body["temperature"] == 0.8 and body["top_p"] == 0.9 and body["top_k"] == 5
    assert body["stop_token_ids"] == [2, 3] and body["logprobs"] == 0 and body["return_token_ids"] is True
    assert body["request_id"] == "r1" and body["model"] == "megappo"
    assert body["skip_special_tokens"] is False and body["stream"] is False


def test_greedy_and_unfiltered_sampling_fields():
    greedy = sampling_fields(SamplingParams(max_new_tokens=3, temperature=0.7, greedy=True), None)
    assert greedy["temperature"] == 0.0 and "seed" not in greedy  # vLLM's greedy; megappo's log-probs then at T = 1
    assert sampling_fields(SamplingParams(max_new_tokens=3, top_k=0), 1)["top_k"] == -1  # 0 and -1: no filter
    assert sampling_fields(SamplingParams(max_new_tokens=3, ignore_eos=True), 1)["ignore_eos"] is True


def test_rows_keep_the_batch_seeds_whatever_share_asks():
    """A share of a batch (prompt_offset) asks with the seeds the whole batch would: the seeds SGLang's rows get."""
    params = SamplingParams(max_new_tokens=2, n=2, seed=5)
    whole = request_seeds(params, 4)
    assert request_seeds(params, 2, prompt_offset=2) == whole[4:]
    assert whole[3] == sample_seed(5, 1, 1, 2)
    bodies = [completion_request([1], params, s, request_id=str(k)) for k, s in enumerate(whole)]
    assert len({b["seed"] for b in bodies}) == len(bodies)
    with pytest.raises(ValueError, match="at least one token"):
        completion_request([], params, 1, request_id="x")


def _choice(ids, logprobs, reason="length", **extra):
    return {"index": 0, "text": "", "token_ids": ids, "finish_reason": reason,
            "logprobs": {"token_logprobs": logprobs, "tokens": [f"token_id:{t}" for t in ids]}, **extra}


def test_a_choice_becomes_a_completion():
    c = parse_choice(_choice([4, 9, 2], [-0.5, -1.0, -0.25], "stop"), 3, weight_version=7, partial=False)
    assert c.prompt_index == 3 and c.output_ids == [4, 9, 2] and c.log_probs == [-0.5, -1.0, -0.25]
    assert c.finish_reason == "stop" and c.weight_version == 7 and c.token_versions is None
    assert parse_choice(_choice([], []), 0, weight_version=1, partial=False).output_ids == []  # max_tokens hit at 0


def test_aborted_choices_and_broken_answers():
    aborted = _choice([4], [-0.1], "abort")
    assert parse_choice(aborted, 0, weight_version=1, partial=True).finish_reason == "abort"
    with pytest.raises(RuntimeError, match="aborted"):
        parse_choice(aborted, 0, weight_version=1, partial=False)
    with pytest.raises(RuntimeError, match="return_token_ids"):
        parse_choice({"finish_reason": "stop", "text": "x"}, 0, weight_version=1, partial=False)
    with pytest.raises(RuntimeError, match="2 tokens with 1 log-probs"):
        parse_choice(_choice([1, 2], [-1.0]), 0, weight_version=1, partial=False)


def test_weight_version_spans_give_each_token_its_version():
    """A generation continued across a sync: vLLM labels output-token ranges with the version that sampled them."""
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    c = parse_choice(_choice([1, 2, 3, 4, 5], [-1.0] * 5, weight_versions=spans), 0, weight_version=4, partial=True)
    assert c.weight_version == 3 and c.token_versions == [3, 3, 4, 4, 4] and c.versions() == [3, 3, 4, 4, 4]
    assert versions_of([{"version": "8", "start": 0, "end": 3}], 3, 1) == (8, None)  # one version: no list
    assert versions_of(None, 2, 6) == (6, None) and versions_of([], 0, 6) == (6, None)
    assert versions_of([{"version": None, "start": 0, "end": 1}, {"version": "x", "start": 1, "end": 2}], 2, 5) \
        == (5, None)  # unlabelled: the client's version


def _npy(array: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def test_routed_experts_decode_to_the_moe_layers():
    layout = RouteLayout((False, True, True), topk=2, num_experts=4)
    ids = np.random.default_rng(0).integers(0, 4, size=(5, 3, 2)).astype(np.uint8)  # prompt 3 + output 3 - 1 tokens
    c = parse_choice(_choice([1, 2, 3], [-1.0] * 3, routed_experts=_npy(ids)), 0, weight_version=1, partial=False,
                     routes=layout)
    assert c.routed_experts.dtype == torch.uint8 and torch.equal(c.routed_experts, torch.from_numpy(ids[:, 1:]))
    moe_only = parse_choice(_choice([1], [-1.0], routed_experts=_npy(ids[:, 1:])), 0, weight_version=1,
                            partial=False, routes=layout)
    assert torch.equal(moe_only.routed_experts, torch.from_numpy(ids[:, 1:]))
    ids[0, 1, 0] = 7
    with pytest.raises(ValueError, match="of a model with 4"):
        parse_choice(_choice([1], [-1.0], routed_experts=_npy(ids)), 0, weight_version=1, partial=False, routes=layout)
    with pytest.raises(RuntimeError, match="--enable-return-routed-experts"):
        parse_choice(_choice([1], [-1.0]), 0, weight_version=1, partial=False, routes=layout)


def test_prompt_log_probs_read_the_prompts_own_tokens():
    body = prompt_logprobs_request([3, 1, 4], request_id="p")
    assert body["prompt_logprobs"] == 0 and body["max_tokens"] == 1 and body["temperature"] == 0.0
    choice = {"prompt_logprobs": [None, {"1": {"logprob": -0.5, "rank": 2}, "9": {"logprob": -0.1, "rank": 1}},
                                  {"4": {"logprob": -2.0, "rank": 7}}]}
    assert parse_prompt_logprobs(choice, [3, 1, 4]) == [-0.5, -2.0]
    with pytest.raises(RuntimeError, match="lack token 4"):
        parse_prompt_logprobs({"prompt_logprobs": [None, {"1": {"logprob": -0.5}}, {"5": {"logprob": -1}}]},
                              [3, 1, 4])
    with pytest.raises(RuntimeError, match="2 prompt log-probs for 3 tokens"):
        parse_prompt_logprobs({"prompt_logprobs": [None, {}]}, [3, 1, 4])
    with pytest.raises(ValueError, match="two tokens"):
        prompt_logprobs_request([3], request_id="p")


def test_lora_ranks_round_up_to_what_vllm_takes():
    assert [max_lora_rank(r) for r in (1, 2, 4, 8, 9, 300, 512)] == [1, 8, 8, 8, 16, 320, 512]
    with pytest.raises(ValueError, match="largest --max-lora-rank"):
        max_lora_rank(513)


def test_the_models_eos_ids_are_stop_tokens_and_ignore_eos_ignores_every_stop(tmp_path):
    """Servers run with --generation-config vllm (only the tokenizer's EOS): every EOS the in-process engine stops on
    (generation_config.json's and config.json's) goes with each request."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    eos = model_eos_ids(str(tmp_path))
    assert eos == (7, 9) and model_eos_ids(str(tmp_path / "nowhere")) == ()
    body = completion_request([1], SamplingParams(max_new_tokens=2, stop_token_ids=(3,)), 1, request_id="r", eos_ids=eos)
    assert body["stop_token_ids"] == [3, 7, 9]
    ignoring = SamplingParams(max_new_tokens=2, stop_token_ids=(3,), ignore_eos=True)
    assert completion_request([1], ignoring, 1, request_id="r", eos_ids=eos)["stop_token_ids"] == []  # nothing stops
