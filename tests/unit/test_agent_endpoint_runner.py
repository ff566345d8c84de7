"""Agent programs run by `AgentRunner` against the endpoint (real `openai` client, real in-process engine), and the
faults an agent or the server can have: an agent that raises, hangs past its deadline, returns nonsense or never
calls, and a server restarted between calls and while a call is in flight. Every row gives exactly one sample, in
order, its flags counted; a revoked key's late call is refused; a retried call is neither lost nor sampled twice."""
from __future__ import annotations

import json
import threading
import time

import openai
import pytest
import torch

from megappo.agents.endpoint import AgentEndpoint
from megappo.agents.runner import AgentRunner, AgentSignatureError, resolve_agent
from megappo.envs.metrics import agent_metrics
from megappo.envs.base import EpisodeRow
from megappo.rollout.base import RolloutEngine
from megappo.rollout.hf.engine import HFEngine
from megappo.rollout.sampling import SamplingParams
from megappo.tasks import tool_sum

torch.set_num_threads(1)
PARAMS = SamplingParams(max_new_tokens=6, temperature=1.0)
PROMPT = [{"role": "user", "content": "37+85+19="}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import transformers

    d = str(tmp_path_factory.mktemp("agent_runner"))
    tok, config = tool_sum.make_tokenizer(tool_sum.ToolTask(), d)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(d)
    return tok, HFEngine(d)


def row(index, kind):
    return EpisodeRow(prompt=PROMPT, data_source="t", ground_truth="141", extra_info={"kind": kind}, index=index,
                      seed=1000 + index)


def two_calls(client, row):
    messages = list(row.prompt)
    for say in ("go", None):
        reply = client.chat.completions.create(model="any", messages=messages)
        if say:
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": say}]
    return reply


RELEASE = threading.Event()
LATE: list = []


def agent(base_url, api_key, row):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    kind = row.extra_info["kind"]
    if kind == "never":
        raise RuntimeError("failed before calling")
    if kind == "dict":
        two_calls(client, row)
        return {"reward": 0.5, "metrics": {"turns": 2}}
    reply = client.chat.completions.create(model="any", messages=list(row.prompt))
    if kind == "raises":
        raise ValueError("agent bug")
    if kind == "hangs":
        RELEASE.wait(30)  # past its deadline; then its key is revoked
        try:
            client.chat.completions.create(model="any", messages=list(row.prompt))
        except openai.AuthenticationError as e:
            LATE.append(e.status_code)
        return 1.0
    if kind == "nonsense":
        return "yes"
    return float(len(reply.choices[0].message.content) > 0)


def test_every_row_gives_one_sample_whatever_its_agent_does(model):
    tok, engine = model
    kinds = ["ok", "raises", "hangs", "dict", "never", "nonsense", "ok", "dict"]
    runner = AgentRunner(agent, tok, max_workers=3, deadline_s=3.0)
    try:
        rows = [row(i, k) for i, k in enumerate(kinds)]
        t0 = time.monotonic()
        out = runner.run(engine, rows, PARAMS)
        assert time.monotonic() - t0 < 20  # the hung agent did not hold the step
        assert [c.prompt_index for c in out] == list(range(len(kinds)))
        flags = [(c.extra["agent"]["error"], c.extra["agent"]["timeout"]) for c in out]
        assert flags == [(0, 0), (1, 0), (0, 1), (0, 0), (1, 0), (1, 0), (0, 0), (0, 0)]
        assert [c.extra["env_reward"] for c in out] == [1.0, None, None, 0.5, None, None, 1.0, 0.5]
        assert [c.extra["agent"]["calls"] for c in out] == [1, 1, 1, 2, 0, 1, 1, 2]
        assert out[3].extra["agent_metrics"] == {"turns": 2.0} and "agent bug" in out[1].extra["agent_error"]
        # a raising or hung agent keeps what it recorded; one that never called gives an empty, flagged sample
        assert len(out[1].output_ids) == 6 and out[1].extra["loss_mask"] == [1] * 6
        assert out[4].output_ids == [] and out[4].finish_reason == "abort" and out[4].extra["prompt_ids"]
        assert out[4].extra["prompt_ids"] == out[0].extra["prompt_ids"]
        for c in out:
            n = len(c.output_ids)
            assert len(c.log_probs) == len(c.extra["loss_mask"]) == len(c.extra["token_versions"]) == n
        m = agent_metrics([c.extra["agent"] for c in out])
        assert m["agent/error_fraction"] == 3 / 8 and m["agent/timeout_fraction"] == 1 / 8
        assert m["agent/no_call_fraction"] == 1 / 8 and m["agent/retokenized_fraction"] == 0.0
        assert m["agent/calls_per_episode"] == 9 / 8
        RELEASE.set()  # the hung agent wakes: its late call is refused
        for _ in range(100):
            if LATE:
                break
            time.sleep(0.1)
        assert LATE == [401]
        # the runner goes on with the next step on the same endpoint; same seeds, same samples
        again = runner.run(engine, [row(0, "ok"), row(6, "ok")], PARAMS)
        assert again[0].output_ids == out[0].output_ids and again[1].output_ids == out[6].output_ids
    finally:
        RELEASE.set()
        runner.close()


def test_an_agent_is_named_by_file_and_function(model, tmp_path):
    tok, engine = model
    path = tmp_path / "my_agent.py"
    path.write_text("import openai\n"
                    "def run(base_url, api_key, row):\n"
                    "    c = openai.OpenAI(base_url=base_url, api_key=api_key)\n"
                    "    r = c.chat.completions.create(model='m', messages=row.prompt)\n"
                    "    return {'reward': 2.0}\n")
    runner = AgentRunner(f"{path}:run", tok, max_workers=2, deadline_s=30)
    try:
        (c,) = runner.run(engine, [row(0, "ok")], PARAMS)
        assert c.extra["env_reward"] == 2.0 and len(c.output_ids) == 6
    finally:
        runner.close()
    with pytest.raises(AgentSignatureError, match=r"agent\(base_url, api_key, row\)"):
        resolve_agent("json:dumps")  # a module's function, found and then refused: it takes (obj, ...)
    with pytest.raises(ValueError):
        resolve_agent("no_function_here")


class Gate(RolloutEngine):
    """The real engine, held at the start of a generation while `hold` is set (to cut a call in flight)."""

    def __init__(self, inner):
        self.inner, self.hold, self.entered, self.go = inner, threading.Event(), threading.Event(), threading.Event()

    def generate(self, prompts, params, **kw):
        if self.hold.is_set():
            self.hold.clear()
            self.entered.set()
            self.go.wait(30)
        return self.inner.generate(prompts, params, **kw)

    def load_weights(self, buckets, *, version, mode, partial=False):
        return version

    def prompt_log_probs(self, token_ids):
        return self.inner.prompt_log_probs(token_ids)


def test_a_server_restart_mid_episode_loses_and_duplicates_nothing(model):
    tok, engine = model
    reference = AgentEndpoint(engine, tok)
    gate = Gate(engine)
    ep = AgentEndpoint(gate, tok)
    try:
        handle = reference.open(77, PARAMS, 100)
        expected = two_calls(openai.OpenAI(base_url=reference.base_url, api_key=handle.api_key), row(0, "ok"))
        expected_calls = reference.close_trajectory(handle).calls
        handle = ep.open(77, PARAMS, 100)
        port = ep.http.port
        client = openai.OpenAI(base_url=ep.base_url, api_key=handle.api_key, max_retries=3)
        messages = list(PROMPT)
        first = client.chat.completions.create(model="any", messages=messages)
        ep.restart()  # between calls
        assert ep.http.port == port
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go"}]
        gate.hold.set()
        out = {}
        caller = threading.Thread(target=lambda: out.update(r=client.chat.completions.create(model="any",
                                                                                           messages=messages)))
        caller.start()
        assert gate.entered.wait(30)
        ep.restart()  # while the call is being generated: it is answered 503 / dropped, not recorded
        gate.go.set()
        caller.join(60)
        record = ep.close_trajectory(handle)
        assert [c.index for c in record.calls] == [0, 1] and [c.segment for c in record.calls] == [0, 0]
        assert [c.output_ids for c in record.calls] == [c.output_ids for c in expected_calls]
        assert out["r"].choices[0].message.content == expected.choices[0].message.content
    finally:
        reference.close()
        ep.close()


def test_a_lost_answer_is_replayed_not_resampled(model):
    tok, engine = model
    ep = AgentEndpoint(engine, tok)
    try:
        handle = ep.open(5, PARAMS, 100)
        auth, body = f"Bearer {handle.api_key}", json.dumps({"messages": PROMPT}).encode()
        lost = ep.chat(auth, body)  # answered and recorded, but never written to the client (no on_sent)
        again = ep.chat(auth, body)
        record = ep.record(handle)
        assert len(record.calls) == 1 and record.replayed_calls == 1
        assert json.loads(again.body)["choices"] == json.loads(lost.body)["choices"]
        again.on_sent()  # delivered: the same request once more is a new call (a new segment)
        ep.chat(auth, body)
        assert len(record.calls) == 2 and record.calls[1].retokenized
    finally:
        ep.close()


def test_requests_beyond_the_limit_get_429_and_close_fails_calls_in_flight(model):
    from megappo.agents.records import EndpointSettings

    tok, engine = model
    gate = Gate(engine)
    ep = AgentEndpoint(gate, tok, EndpointSettings(max_concurrent_requests=1))
    closed = False
    try:
        a, b = ep.open(1, PARAMS, 100), ep.open(2, PARAMS, 100)
        gate.hold.set()
        errors = []

        def held():
            try:
                openai.OpenAI(base_url=ep.base_url, api_key=a.api_key, max_retries=0).chat.completions.create(
                    model="any", messages=PROMPT)
            except openai.APIError as e:
                errors.append(e)

        caller = threading.Thread(target=held)
        caller.start()
        assert gate.entered.wait(30)
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=ep.base_url, api_key=b.api_key, max_retries=0).chat.completions.create(
                model="any", messages=PROMPT)
        t0 = time.monotonic()
        ep.close()  # the held call is failed, not waited for
        closed = True
        caller.join(30)
        assert time.monotonic() - t0 < 10 and len(errors) == 1 and not caller.is_alive()
        assert ep.record(a).calls == [] and ep.record(b).calls == []
    finally:
        gate.go.set()
        if not closed:
            ep.close()
        ep.batcher._thread.join(30)  # the held batch ends in the engine (not at interpreter exit, inside torch)


PROCESS_AGENT = '''import os, time
import openai


def play(base_url, api_key, row):
    kind = row.extra_info["kind"]
    if kind == "hang":
        open(os.environ["PID_FILE"] + str(row.index), "w").write(str(os.getpid()))
        time.sleep(600)
    if kind == "raise":
        raise ValueError("agent bug in a process")
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(model="any", messages=list(row.prompt))
    return 0.5
'''


def test_process_backend_kills_a_hung_agent_at_its_deadline(model, tmp_path, monkeypatch):
    """rollout.agent.backend=process: each episode in a spawned process; the hung one is killed at the deadline
    (a thread could not be), the raising one is flagged, the good one's call and reward come back."""
    import os

    from megappo.agents.processes import ProcessAgent

    tok, engine = model
    (tmp_path / "proc_agent.py").write_text(PROCESS_AGENT)
    monkeypatch.setenv("PID_FILE", str(tmp_path / "pid"))
    runner = AgentRunner(ProcessAgent(f"{tmp_path / 'proc_agent.py'}:play", deadline_s=10.0), tok, deadline_s=10.0)
    try:
        ok, bad, hung = runner.run(engine, [row(0, "ok"), row(1, "raise"), row(2, "hang")], PARAMS)
    finally:
        runner.close()
    assert ok.extra["env_reward"] == 0.5 and ok.extra["agent"]["calls"] == 1 and len(ok.output_ids) > 0
    assert bad.extra["agent"]["error"] == 1.0 and "agent bug in a process" in bad.extra["agent_error"]
    assert hung.extra["agent"]["error"] + hung.extra["agent"]["timeout"] >= 1.0
    pid = int((tmp_path / "pid2").read_text())
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the hung agent's process {pid} outlived its deadline")


async def async_agent(base_url, api_key, row):
    """Written as many agents are: on AsyncOpenAI, awaiting its calls."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    try:
        reply = await client.chat.completions.create(model="any", messages=list(row.prompt))
        return {"reward": 3.0, "metrics": {"chars": len(reply.choices[0].message.content)}}
    finally:
        await client.close()


def test_an_async_agent_runs_to_its_end(model):
    tok, engine = model
    runner = AgentRunner(async_agent, tok, max_workers=2, deadline_s=30)
    try:
        out = runner.run(engine, [row(0, "ok"), row(1, "ok")], PARAMS)
        for c in out:
            assert c.extra["agent_error"] is None and c.extra["env_reward"] == 3.0
            assert len(c.output_ids) == 6 and c.extra["agent"]["calls"] == 1
            assert c.extra["agent_metrics"]["chars"] > 0
    finally:
        runner.close()


def wrong_signature(base_url, row):
    return 1.0


def test_an_agent_that_cannot_take_the_call_is_refused_when_it_loads(model):
    tok, _ = model
    with pytest.raises(AgentSignatureError, match=r"\(base_url, row\).*agent\(base_url, api_key, row\)"):
        AgentRunner(wrong_signature, tok)
    from megappo.agents.program import AgentProgramLoop
    from megappo.envs.loop import EpisodeSettings

    s = EpisodeSettings(None, False, 8, None, None, "disable", num_workers=2)
    with pytest.raises(AgentSignatureError, match=r"agent\(base_url, api_key, row, level=\.\.\.\)"):
        AgentProgramLoop("mine", agent, tok, s, spec="my.py:agent", kwargs={"level": 3})


def returns(value):
    def fn(base_url, api_key, row):
        openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0).chat.completions.create(
            model="any", messages=list(row.prompt))
        return value
    return fn


@pytest.mark.parametrize("value, said", [
    (float("nan"), "returned float nan as its reward"), ("1.0", "returned str '1.0' as its reward"),
    ([1.0], "returned list as its reward"), ({"reward": "high"}, "returned str 'high' as its reward"),
    ({"reward": 1.0, "metrics": {"ok": "yes"}}, "not numbers: ['ok']"), (True, "returned bool as its reward")])
def test_an_agent_that_returns_no_number_fails_its_episode_with_what_it_returned(model, value, said):
    tok, engine = model
    runner = AgentRunner(returns(value), tok, max_workers=1, deadline_s=30)
    try:
        (c,) = runner.run(engine, [row(0, "ok")], PARAMS)
        assert said in c.extra["agent_error"] and c.extra["agent"]["error"] == 1.0
        assert c.extra["env_reward"] is None and len(c.output_ids) == 6
    finally:
        runner.close()
