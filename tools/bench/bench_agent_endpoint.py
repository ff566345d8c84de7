"""The agent endpoint's cost per call (megappo/agents/endpoint.py) at --episodes concurrent episodes, against calling
the engine directly.

A random-weight tiny Qwen2 (the tool task's tokenizer and chat template, megappo/tasks/tool_sum.py) on the in-process
engine (`HFEngine`), so engine time is small. Each episode makes --turns calls of --max-tokens tokens (EOS ignored:
every call generates the same number of tokens), each call continuing its conversation (a user message after each
answer), so every call after the first goes through the segment-continuation path. The episodes' clients run in a
process of their own (their CPU is not the server's), one thread per episode, all starting together.

--think-ms spreads the calls: each episode waits uniform(0, think) before each call, as an agent that runs tools
between calls does (0: every episode calls at once, the worst case for a single-process server).

Per call, overhead = the client's latency - the engine time of the call's batch - the time the engine was busy
with an earlier batch when the call arrived (what calling the engine directly also waits for). What remains is the
batch's gathering window (--batch-wait-ms), the HTTP round trip, parsing, rendering, tokenising, recording and the
response. Rows:
    direct   the episodes call the endpoint's batcher in process with prompt ids (the engine with batching, no
             endpoint): its own overhead is the gathering window and the thread hand-off
    raw      the endpoint over HTTP, keep-alive http.client connections (the client's own cost is small)
    openai   the endpoint with the real `openai` client (pydantic, httpx: its own cost is in the latency)
    server   the endpoint's own time per call as it records it (from the request's body read to its reply, queue
             and engine time left out), for the openai row
Printed: median and p99 of the overhead in ms, the engine time per batch and the mean batch size.

    python tools/bench/bench_agent_endpoint.py [--episodes 64 --turns 4 --max-tokens 4 --batch-wait-ms 2]
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

PROMPT = [{"role": "user", "content": "37+85+19="}]


def _episode(mode: str, base_url: str, key: str, turns: int, max_tokens: int, think_s: float, barrier
             ) -> list[float]:
    """One episode's call latencies in seconds."""
    import random

    messages, out, rng = list(PROMPT), [], random.Random(key)
    if mode == "openai":
        import openai

        client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=300)
    else:
        host, port = base_url.split("//")[1].split("/")[0].split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=300)
    barrier.wait()
    for turn in range(turns):
        time.sleep(rng.uniform(0, think_s))  # the agent's own work between calls (tools, parsing)
        t0 = time.perf_counter()
        if mode == "openai":
            content = client.chat.completions.create(model="m", messages=messages,
                                                     max_tokens=max_tokens).choices[0].message.content
        else:
            body = json.dumps({"model": "m", "messages": messages, "max_tokens": max_tokens}).encode()
            conn.request("POST", "/v1/chat/completions", body=body,
                         headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
            resp = conn.getresponse()
            content = json.loads(resp.read())["choices"][0]["message"]["content"]
        out.append(time.perf_counter() - t0)
        messages += [{"role": "assistant", "content": content}, {"role": "user", "content": f"turn {turn}"}]
    return out


def run_clients(mode: str, base_url: str, keys: list[str], turns: int, max_tokens: int, think_s: float
                ) -> list[list[float]]:
    """Every episode at once, one thread each (in the clients' process)."""
    barrier = threading.Barrier(len(keys))
    out: list = [None] * len(keys)

    def one(k):
        out[k] = _episode(mode, base_url, keys[k], turns, max_tokens, think_s, barrier)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(keys))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _direct(endpoint, prompt_ids: list[int], params, episodes: int, turns: int) -> list[float]:
    """The batcher called in process (no HTTP, no rendering): overhead per call in seconds."""
    from megappo.rollout.seeds import sample_seed

    barrier, out, lock = threading.Barrier(episodes), [], threading.Lock()

    def one(k):
        barrier.wait()
        prompt = list(prompt_ids)
        for turn in range(turns):
            t0 = time.perf_counter()
            call = endpoint.batcher.submit(prompt, params, sample_seed(k, turn, 0, 1))
            c = call.result(300)
            latency = time.perf_counter() - t0
            with lock:
                out.append(latency - call.engine_s - call.busy_s)
            prompt = prompt + c.output_ids + prompt_ids[-6:]  # grows as a conversation would

    threads = [threading.Thread(target=one, args=(k,)) for k in range(episodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _stats(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return statistics.median(xs) * 1e3, xs[min(len(xs) - 1, int(0.99 * len(xs)))] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--batch-wait-ms", type=float, default=2.0)
    ap.add_argument("--think-ms", type=float, default=0.0,
                    help="each episode waits uniform(0, think) before each call (0: all in lockstep)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--modes", default="direct,raw,openai")
    ap.add_argument("--engine", choices=("hf", "process"), default="process",
                    help="hf: HFEngine in this process (its decode loop holds the GIL the endpoint needs); process: "
                         "HFProcessEngine, the same engine in a child process (as an SGLang server is elsewhere)")
    args = ap.parse_args()

    import torch
    import transformers

    from megappo.agents.endpoint import AgentEndpoint
    from megappo.agents.records import EndpointSettings
    from megappo.rollout.hf.engine import HFEngine
    from megappo.rollout.hf.process import HFProcessEngine
    from megappo.rollout.sampling import SamplingParams
    from megappo.tasks import tool_sum

    torch.set_num_threads(args.threads)
    d = tempfile.mkdtemp(prefix="bench_agent_")
    tok, config = tool_sum.make_tokenizer(tool_sum.ToolTask(), d)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(d)
    engine = (HFEngine(d, max_num_seqs=args.episodes) if args.engine == "hf"
              else HFProcessEngine(d, threads=args.threads, max_num_seqs=args.episodes))
    params = SamplingParams(max_new_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)
    settings = EndpointSettings(batch_wait_s=args.batch_wait_ms / 1e3, max_batch=args.episodes,
                                max_prompt_tokens=1 << 20)
    endpoint = AgentEndpoint(engine, tok, settings)
    print(f"engine {args.engine}; episodes {args.episodes}, {args.turns} calls each of {args.max_tokens} tokens; "
          f"batch wait {args.batch_wait_ms} ms; think {args.think_ms} ms; torch threads {args.threads}; cpus {os.cpu_count()}; "
          f"load {os.getloadavg()[0]:.2f}")
    print(f"{'mode':>7} {'median ms':>10} {'p99 ms':>8} {'engine ms/batch':>16} {'calls/batch':>12}")
    clients = ProcessPoolExecutor(1, mp_context=get_context("spawn"))
    clients.submit(time.sleep, 0).result()  # the clients' process is up before timing
    prompt_ids = endpoint.builder.fresh(PROMPT, None).prompt_ids
    for mode in args.modes.split(","):
        batches0 = endpoint.batcher.batches
        if mode == "direct":
            overhead, engine_times = _direct(endpoint, prompt_ids, params, args.episodes, args.turns), []
        else:
            handles = [endpoint.open(k, params, budget_tokens=1 << 20) for k in range(args.episodes)]
            latencies = clients.submit(run_clients, mode, endpoint.base_url, [h.api_key for h in handles],
                                       args.turns, args.max_tokens, args.think_ms / 1e3).result()
            records = [endpoint.close_trajectory(h) for h in handles]
            overhead, own, engine_times = [], [], []
            for record, lat in zip(records, latencies):
                assert len(record.calls) == args.turns and all(not c.retokenized for c in record.calls)
                for call, latency in zip(record.calls, lat):
                    overhead.append(latency - call.engine_s - call.busy_s)
                    own.append(call.overhead_s)
                    engine_times.append(call.engine_s)
        batches = endpoint.batcher.batches - batches0
        med, p99 = _stats(overhead)
        eng = statistics.median(engine_times) * 1e3 if engine_times else float("nan")
        print(f"{mode:>7} {med:>10.2f} {p99:>8.2f} {eng:>16.1f} {args.episodes * args.turns / batches:>12.1f}")
        if mode == "openai":
            med, p99 = _stats(own)
            print(f"{'server':>7} {med:>10.2f} {p99:>8.2f}")
    clients.shutdown()
    endpoint.close()
    engine.close()


if __name__ == "__main__":
    main()
