"""`SGLangFleet` over two real SGLang servers: the rows of a batch are spread over both and come back once each,
a server killed with SIGKILL in the middle of a generation costs no sample (its rows go to the other server with
their seeds), and one weight broadcast updates both servers."""
from __future__ import annotations

import os
import secrets
import signal
import threading
import time

import psutil
import pytest

from megappo.rollout import HFEngine, SamplingParams
from megappo.rollout.sglang.engine import SGLangEngine
from megappo.rollout.sglang.fleet import SGLangFleet
from megappo.rollout.sglang.server import SGLangServer
from megappo.testing.completions import tokens

pytestmark = [pytest.mark.e2e, pytest.mark.sglang]
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [3], [4, 4], [8, 1, 2], [7]]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)


def _log_lines(server) -> list[str]:
    with open(server.log.name, errors="replace") as f:
        return f.read().splitlines()


def _requests(lines) -> list[str]:
    """The path of each request in the server's access log lines (uvicorn's `INFO:     127.0.0.1:PORT - "POST /path
    HTTP/1.1" 200 OK`)."""
    import re

    found = (re.search(r' - "(?:GET|POST) (/[^ ?"]*)', line) for line in lines)
    return [m.group(1) for m in found if m]


@pytest.fixture()
def two_servers(sglang_python, hf_model_dir):
    model = hf_model_dir("qwen2")
    key = secrets.token_urlsafe(16)  # one key for the fleet, as the trainer gives its servers (a router needs it)
    servers = [SGLangServer(model, python=sglang_python, api_key=key) for _ in range(2)]
    starters = [threading.Thread(target=s.start) for s in servers]
    try:
        for t in starters:
            t.start()
        for t in starters:
            t.join()
        assert all(s.proc is not None and s.proc.poll() is None for s in servers), "a server did not start"
        yield model, servers
    finally:
        for s in servers:
            s.stop()


def test_fleet_spreads_rows_streams_weights_to_all_and_survives_a_killed_server(two_servers, tmp_path):
    from safetensors.torch import load_file

    from megappo.testing.hf_models import make_hf_model

    model, servers = two_servers
    fleet = SGLangFleet([s.url for s in servers])
    got = fleet.generate(PROMPTS, GREEDY)
    assert tokens(got) == tokens(HFEngine(model).generate(PROMPTS, GREEDY)) and fleet.retried_rows == 0

    # the real sglang-router in front of both: with other weights on the second server, each row's answer is one
    # of the two models', and both models answer (the router spread the rows); a wrong key is refused
    from megappo.rollout.sglang.router import SGLangRouter
    from megappo.rollout.serving.http_client import http_json

    routed = make_hf_model("qwen2", str(tmp_path / "routed"), seed=3)
    SGLangEngine(servers[1].url).update_weights_from_disk(routed, version=1)
    with SGLangRouter([s.url for s in servers], python=servers[0].python, api_key=servers[0].api_key) as router:
        assert router.healthy_workers() == sorted(s.url for s in servers)
        via = SGLangFleet([s.url for s in servers], router_url=router.url).generate(PROMPTS * 2, GREEDY)
        first, second = (tokens(HFEngine(m).generate(PROMPTS * 2, GREEDY)) for m in (model, routed))
        answers = ["first" if t == a else "second" if t == b else "neither"
                   for t, a, b in zip(tokens(via), first, second)]
        assert "neither" not in answers and set(answers) == {"first", "second"}, answers
        with pytest.raises(RuntimeError, match="401"):
            http_json(router.url + "/workers", timeout=5, api_key="wrong")
        router_pid = router.proc.pid
    assert not psutil.pid_exists(router_pid) or psutil.Process(router_pid).status() == psutil.STATUS_ZOMBIE
    SGLangEngine(servers[1].url).update_weights_from_disk(model, version=0)

    sampled = SamplingParams(max_new_tokens=6, temperature=1.0, n=3, ignore_eos=True, seed=11)
    groups = fleet.generate(PROMPTS, sampled)
    assert [len(g) for g in groups] == [3] * len(PROMPTS)
    assert all(c.prompt_index == i for i, g in enumerate(groups) for c in g)

    # one broadcast per tensor reaches both servers (each server's ranks sit at their own offset in the group)
    new = make_hf_model("qwen2", str(tmp_path / "new"), seed=5)
    tensors = sorted(load_file(os.path.join(new, "model.safetensors")).items())
    assert fleet.update_weights([tensors[i:i + 4] for i in range(0, len(tensors), 4)], version=7) == 7
    got = fleet.generate(PROMPTS, GREEDY)
    assert tokens(got) == tokens(HFEngine(new).generate(PROMPTS, GREEDY))
    assert all(c.weight_version == 7 for g in got for c in g)
    assert {c.extra["sglang_weight_version"] for g in got for c in g} == {"7"}  # both servers answered
    fleet.close_weight_group()

    # tensor mode (colocated servers): the tensors go by shared-memory handle, with the same result
    other = make_hf_model("qwen2", str(tmp_path / "other"), seed=9)
    tensors = sorted(load_file(os.path.join(other, "model.safetensors")).items())
    fleet.pause()
    assert fleet.update_weights_from_tensor([tensors[i:i + 4] for i in range(0, len(tensors), 4)], version=8) == 8
    fleet.resume()
    fleet.check_version(8)
    assert tokens(fleet.generate(PROMPTS, GREEDY)) == tokens(HFEngine(other).generate(PROMPTS, GREEDY))
    # a second tensor sync reuses the shared buffers of the first: the servers read the new values, not stale ones
    third = make_hf_model("qwen2", str(tmp_path / "third"), seed=10)
    tensors = sorted(load_file(os.path.join(third, "model.safetensors")).items())
    buffers = [b.data_ptr() for b in fleet._shm_staging.buffers]
    assert fleet.update_weights_from_tensor([tensors[i:i + 4] for i in range(0, len(tensors), 4)], version=9) == 9
    assert [b.data_ptr() for b in fleet._shm_staging.buffers] == buffers
    assert tokens(fleet.generate(PROMPTS, GREEDY)) == tokens(HFEngine(third).generate(PROMPTS, GREEDY))
    # ...and a bucket larger than a slot grows it: the whole of `other` in one bucket
    whole = sorted(load_file(os.path.join(other, "model.safetensors")).items())
    assert fleet.update_weights_from_tensor([whole], version=10) == 10
    assert tokens(fleet.generate(PROMPTS, GREEDY)) == tokens(HFEngine(other).generate(PROMPTS, GREEDY))
    lps = fleet.prompt_log_probs(PROMPTS[1])
    assert len(lps) == 2 and lps[0] == pytest.approx(lps[1], abs=1e-5) and len(lps[0]) == len(PROMPTS[1]) - 1
    new = other

    # the trainer's whole sync in each mode (the health probe of the heal, then pause, send, resume, version check)
    # asks nothing that SGLang answers after a poll: not GET /health, whose handler looks for its one-token
    # generation after asyncio.sleep(1) (that second was the whole floor of a tiny model's sync)
    from megappo.rollout.sglang.health import is_healthy
    from megappo.trainer.weight_sync import around_sync

    buckets = lambda: [tensors[i:i + 4] for i in range(0, len(tensors), 4)]  # noqa: E731 - `third`'s
    sends = {"distributed": lambda v: fleet.update_weights(buckets(), version=v),
             "tensor": lambda v: fleet.update_weights_from_tensor(buckets(), version=v),
             "disk": lambda v: fleet.update_weights_from_disk(other, version=v)}
    for version, (mode, send) in enumerate(sends.items(), start=11):
        marks = [len(_log_lines(s)) for s in servers]
        assert all(is_healthy(s.url) for s in servers)  # as ServerSet.heal asks each server before a sync
        around_sync(fleet, version, lambda: send(version))
        for s, mark in zip(servers, marks):
            asked = _requests(_log_lines(s)[mark:])
            assert "/health" not in asked and asked[0] == "/generate" and asked[-1] == "/model_info", (mode, asked)
    assert tokens(fleet.generate(PROMPTS, GREEDY)) == tokens(HFEngine(other).generate(PROMPTS, GREEDY))

    # SIGKILL the second server while it generates a long batch: every sample still comes back, once
    long = SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True, n=4)  # seconds of work per server
    expected = HFEngine(new).generate(PROMPTS, long)
    result: dict = {}
    worker = threading.Thread(target=lambda: result.setdefault("groups", fleet.generate(PROMPTS, long)))
    worker.start()
    time.sleep(0.5)

    # the SGLang process group under the server's watchdog (as when the server crashes or is OOM-killed)
    sglang_pid = psutil.Process(servers[1].proc.pid).children()[0].pid
    os.killpg(sglang_pid, signal.SIGKILL)
    worker.join(300)
    assert not worker.is_alive()
    assert tokens(result["groups"]) == tokens(expected)
    assert fleet.alive == [True, False] and fleet.retried_rows > 0

    # later calls use the survivor alone: a reload from disk and a generation
    again = make_hf_model("qwen2", str(tmp_path / "again"), seed=6)
    assert fleet.update_weights_from_disk(again) == 14
    assert tokens(fleet.generate(PROMPTS, GREEDY)) == tokens(HFEngine(again).generate(PROMPTS, GREEDY))
