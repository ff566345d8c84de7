"""Round trip of one sandboxed Python call, one at a time and from several threads at once.

    python tools/bench/bench_tool_sandbox.py [--calls 200] [--threads 4] [--repeat 1]

Every call runs `print(1)`, so its time is the sandbox's overhead: the call's socket to the zygote and on to the
spare supervisor set up before the call (its mount and PID namespaces and tmpfs, its runner forked into the call's
memory cgroup with its IPC/network/UTS namespaces and /proc; the zygote then forks the next spare), the request,
the cgroup's limit, the runner's uid, user namespace, capabilities, limits, keyring and seccomp filter, the code,
its exit (its PID namespace's end) and the answer. Reported: median, p90 and p99 of the round trip (and the
request's share of the set-up, and request-to-exit), calls/s from N threads, and, for scale, a fresh
`python -I -c pass`. The machine's load average is printed beside each run (other jobs share the CPU).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megappo.multi_turn.python_tool import PythonTool  # noqa: E402
from megappo.sandbox import Limits, Sandbox  # noqa: E402

SCHEMA = {"type": "function", "function": {"name": "code_interpreter", "parameters": {"type": "object"}}}


def ms(xs: list[float]) -> str:
    xs = sorted(x * 1000 for x in xs)
    pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return (f"median {statistics.median(xs):6.1f}  p90 {pick(0.9):6.1f}  p99 {pick(0.99):6.1f}  "
            f"min {xs[0]:5.1f} ms (n={len(xs)})")


def load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def sequential(sb: Sandbox, n: int) -> None:
    rt, setup, run = [], [], []
    for _ in range(n):
        r = sb.run("print(1)")
        assert r.stdout == "1\n" and r.error is None, r
        rt.append(r.latency_s)
        setup.append(r.setup_s)
        run.append(r.run_s)
    print(f"  one at a time      {ms(rt)}")
    print(f"    request's set-up   {ms(setup)}   (tmpfs size, cgroup limit: the rest is done before the call)")
    print(f"    request..exit      {ms(run)}   (privilege drop, seccomp, the code, its PID namespace's end)")


def concurrent(sb: Sandbox, n: int, threads: int) -> None:
    lat: list[float] = []
    lock = threading.Lock()

    def worker(k: int) -> None:
        for _ in range(k):
            r = sb.run("print(1)")
            assert r.stdout == "1\n" and r.error is None, r
            with lock:
                lat.append(r.latency_s)

    t = time.monotonic()
    ths = [threading.Thread(target=worker, args=(n // threads,)) for _ in range(threads)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    wall = time.monotonic() - t
    print(f"  {threads} threads          {ms(lat)}; {len(lat) / wall:.0f} calls/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    print(f"{os.cpu_count()} cores; euid {os.geteuid()}; load average {load()}")
    t0 = time.monotonic()
    sb = Sandbox(Limits(timeout_s=10)).start()
    print(f"zygote start: {(time.monotonic() - t0) * 1000:.0f} ms; mode {sb.state['mode']}, memory cgroup "
          f"{sb.state['memory']['cgroup']}, seccomp {sb.state['filter']}")
    for _ in range(5):
        sb.run("pass")  # warm: the cgroup slots are made at first use
    for k in range(args.repeat):
        print(f"run {k + 1}: load average {load()}")
        sequential(sb, args.calls)
        concurrent(sb, args.calls, args.threads)
    r = sb.run("import numpy")
    print(f"`import numpy` inside: {r.latency_s * 1000:.0f} ms round trip")
    sb.close()
    tool = PythonTool({"timeout_s": 10}, SCHEMA).start()
    lat = [tool.execute("b", {"code": "print(1)"}).metrics["latency_s"] for _ in range(min(args.calls, 50))]
    tool.close()
    print(f"PythonTool.execute     {ms(lat)}")
    fresh = []
    for _ in range(20):
        t = time.monotonic()
        subprocess.run([sys.executable, "-I", "-c", "pass"], check=True)
        fresh.append(time.monotonic() - t)
    print(f"no sandbox: fresh `python -I -c pass`  {ms(fresh)}")
    print(f"load average after: {load()}")


if __name__ == "__main__":
    main()
