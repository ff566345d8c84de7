"""Per-call overhead of the sandboxed Python tool, beside starting a fresh interpreter per call.

    python tools/bench/bench_tool_sandbox.py [--calls 60] [--threads 4]

Every call runs `pass`, so its time is the sandbox's overhead alone: the request to the zygote, the supervisor's
fork, its mount and PID namespaces and tmpfs, the runner's fork, /proc, limits, uid drop and exit (its PID
namespace's end), and the answer. The rest of the clean-up (reaping, the tmpfs) runs after the answer; it is timed
apart, as the time until the call's supervisor has exited. Methods are interleaved call by call so that a loaded machine weighs on each alike; the load average is
printed. Also: the zygote's start (once per sandbox), a PythonTool round trip through the ToolPool, and calls
from several threads at once.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megappo.multi_turn.pool import ToolPool  # noqa: E402
from megappo.multi_turn.python_tool import PythonTool  # noqa: E402
from megappo.multi_turn.sandbox import Limits, Sandbox  # noqa: E402

SCHEMA = {"type": "function", "function": {"name": "code_interpreter", "parameters": {"type": "object"}}}


def ms(xs: list[float]) -> str:
    xs = sorted(x * 1000 for x in xs)
    return (f"min {xs[0]:6.1f}  median {statistics.median(xs):6.1f}  p90 {xs[int(0.9 * (len(xs) - 1))]:6.1f} ms "
            f"(n={len(xs)})")


def supervisor_gone_s(sb: Sandbox, t_answer: float) -> float:
    """Seconds from the answer until the zygote has no child left (the call's clean-up is over)."""
    import psutil

    z = psutil.Process(sb.zygote_pid)
    while any(c.status() != psutil.STATUS_ZOMBIE for c in z.children()):
        time.sleep(0.0005)
    return time.monotonic() - t_answer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--threads", type=int, default=4)
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; euid {os.geteuid()}")

    t0 = time.monotonic()
    sb = Sandbox(Limits(timeout_s=10)).start()
    print(f"zygote start (python -I, namespaces, read-only remount): {(time.monotonic() - t0) * 1000:.0f} ms; "
          f"isolation: {sb.state}")
    for _ in range(3):
        sb.run("pass")  # warm

    rt, setup, run, cleanup, fresh_s, fresh_site = [], [], [], [], [], []
    for _ in range(args.calls):
        r = sb.run("pass")
        t_answer = time.monotonic()
        assert r.exit_code == 0 and r.error is None, r
        rt.append(r.latency_s)
        setup.append(r.setup_s)
        run.append(r.run_s)
        cleanup.append(supervisor_gone_s(sb, t_answer))
        t = time.monotonic()
        subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], check=True)
        fresh_s.append(time.monotonic() - t)
        t = time.monotonic()
        subprocess.run([sys.executable, "-I", "-c", "pass"], check=True)
        fresh_site.append(time.monotonic() - t)

    print("\nper call, code `pass` (the overhead alone):")
    print(f"  sandbox round trip           {ms(rt)}")
    print(f"    supervisor set-up          {ms(setup)}   (mount namespace + tmpfs + pipes)")
    print(f"    runner fork..exit          {ms(run)}   (fork, /proc, rlimits, uid drop, exec, exit seen)")
    print(f"    rest                       {ms([a - b - c for a, b, c in zip(rt, setup, run)])}   "
          "(request, supervisor fork, answer)")
    print(f"  clean-up after the answer    {ms(cleanup)}   (reaping, tmpfs; off the round trip)")
    print(f"  no sandbox: fresh `python -I -S -c pass`  {ms(fresh_s)}")
    print(f"  no sandbox: fresh `python -I -c pass`     {ms(fresh_site)}   (site-packages, as the code needs)")

    r = sb.run("import numpy")
    print(f"\n`import numpy` inside the sandbox: {r.latency_s * 1000:.0f} ms round trip (the code's own time)")
    sb.close()

    tool = PythonTool({"timeout_s": 10}, SCHEMA).start()
    with ToolPool({"code_interpreter": tool}, max_workers=args.threads) as pool:
        for _ in range(3):
            pool.execute("code_interpreter", "w", {"code": "pass"})
        lat = []
        for k in range(args.calls):
            t = time.monotonic()
            res = pool.execute("code_interpreter", f"i{k}", {"code": "print(1)"})
            lat.append(time.monotonic() - t)
            assert res.text == "1\n", res.text
        print(f"PythonTool via ToolPool, one at a time: {ms(lat)}")
        n = args.calls
        t = time.monotonic()
        results = pool.map([("code_interpreter", f"j{k}", {"code": "print(1)"}) for k in range(n)])
        wall = time.monotonic() - t
        assert all(r.text == "1\n" for r in results)
        print(f"PythonTool via ToolPool, {n} calls on {args.threads} threads: {wall:.2f} s, "
              f"{n / wall:.0f} calls/s, per-call latency {ms([r.metrics['latency_s'] for r in results])}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
