"""Every node joins before torchrun starts: `launch/torchrun.sh` runs this on each node of a multi-node launch.

torchrun alone waits for a node that never comes until its rendezvous times out (15 minutes), and then says only
how many joined. Here node 0 holds a small TCPStore at MASTER_ADDR:MASTER_PORT+1 for the length of the check; every
node posts its host name and ranks, and node 0 waits up to `--timeout` seconds for all of them. It then fails naming
the missing node ranks (and, under Slurm, their host names) and the nodes that did join; a node that cannot reach
node 0 fails naming the address. What is exposed: that port, on every interface of node 0, until every node has
joined or the timeout passes; it holds host names and rank counts, nothing else.

    python -m megappo.platform.join --nnodes N --node-rank R --master-addr A --port P [--nproc K]
        [--timeout S] [--hosts h0,h1,...]

Exit status 0 when every node joined (on every node), 2 otherwise.
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from datetime import timedelta
from typing import Optional, Sequence

DEFAULT_TIMEOUT_S = 600  # a cold node (container pull, module loads) can start minutes after the first
GONE_WAIT_S = 30  # how long node 0 keeps the store up for nodes still reading the verdict


def _fail(message: str) -> int:
    print(f"megappo join: {message}", file=sys.stderr, flush=True)
    return 2


def _describe(ranks: Sequence[int], hosts: Sequence[str]) -> str:
    return ", ".join(f"{r} ({hosts[r]})" if r < len(hosts) else str(r) for r in ranks)


def _joined(joined: dict[int, dict], with_ranks: bool = False) -> str:
    return ", ".join(f"{r} ({j['host']}" + (f", {j['nproc']} rank(s))" if with_ranks else ")")
                     for r, j in sorted(joined.items())) or "none"


def join(nnodes: int, node_rank: int, master_addr: str, port: int, *, nproc: int = 1,
         timeout_s: float = DEFAULT_TIMEOUT_S, hosts: Sequence[str] = ()) -> int:
    """Meet the other nodes (see the module docstring); returns the exit status."""
    from torch.distributed import TCPStore

    if nnodes <= 1:
        return 0
    me = json.dumps({"host": socket.gethostname(), "nproc": nproc})
    timeout = timedelta(seconds=timeout_s)
    try:
        store = TCPStore(master_addr, port, None, node_rank == 0, timeout, wait_for_workers=False)
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError/DistNetworkError/TimeoutError by version
        if node_rank == 0:
            return _fail(f"node 0 cannot listen on port {port} for the join check ({str(e).splitlines()[0]}): "
                         "set MASTER_PORT to a free port (the check uses MASTER_PORT+1)")
        return _fail(f"node {node_rank} could not reach node 0 at {master_addr}:{port} within {timeout_s:.0f} s "
                     f"({str(e).splitlines()[0][:200]}): is node 0 started, is MASTER_ADDR its address as seen from "
                     "this node, and is the port open between the nodes?")
    store.set(f"node/{node_rank}", me)
    if node_rank != 0:
        return _follow(store, node_rank, timeout_s)
    return _lead(store, nnodes, timeout_s, hosts)


def _lead(store, nnodes: int, timeout_s: float, hosts: Sequence[str]) -> int:
    keys = [f"node/{r}" for r in range(nnodes)]
    deadline = time.monotonic() + timeout_s
    missing = list(range(nnodes))
    while missing and time.monotonic() < deadline:
        missing = [r for r in missing if not store.check([keys[r]])]
        if missing:
            time.sleep(0.2)
    joined = {r: json.loads(store.get(keys[r])) for r in range(nnodes) if r not in missing}
    if missing:
        verdict = (f"node rank(s) {_describe(missing, hosts)} of {nnodes} did not join within {timeout_s:.0f} s "
                   f"(MEGAPPO_JOIN_TIMEOUT); joined: {_joined(joined)}. Start launch/torchrun.sh "
                   "on the missing node(s) with the same NNODES, MASTER_ADDR and MASTER_PORT, or check why their "
                   "job step did not start")
    else:
        verdict = ""
    store.set("verdict", verdict or "ok")
    # keep the store up until the nodes that joined have read the verdict (bounded: one may die meanwhile)
    until = time.monotonic() + GONE_WAIT_S
    while store.add("read", 0) < len(joined) - 1 and time.monotonic() < until:
        time.sleep(0.1)
    if verdict:
        return _fail(verdict)
    print(f"megappo join: all {nnodes} nodes joined: {_joined(joined, with_ranks=True)}", file=sys.stderr, flush=True)
    return 0


def _follow(store, node_rank: int, timeout_s: float) -> int:
    try:
        store.wait(["verdict"], timedelta(seconds=timeout_s + GONE_WAIT_S))
        verdict = store.get("verdict").decode()
        store.add("read", 1)
    except Exception as e:  # noqa: BLE001 - node 0 went away before it decided
        return _fail(f"node {node_rank}: node 0 stopped before every node joined ({str(e).splitlines()[0][:200]})")
    if verdict != "ok":
        return _fail(f"node {node_rank}: {verdict}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megappo.platform.join", description=__doc__.split("\n\n")[0])
    p.add_argument("--nnodes", type=int, required=True)
    p.add_argument("--node-rank", type=int, required=True)
    p.add_argument("--master-addr", required=True)
    p.add_argument("--port", type=int, required=True, help="the join check's port (torchrun.sh: MASTER_PORT+1)")
    p.add_argument("--nproc", type=int, default=1, help="ranks on this node (reported)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds to wait for every node")
    p.add_argument("--hosts", default="", help="comma-separated host names by node rank, to name missing nodes")
    a = p.parse_args(argv)
    if not 0 <= a.node_rank < a.nnodes:
        return _fail(f"NODE_RANK={a.node_rank} is not in 0..{a.nnodes - 1} (NNODES={a.nnodes})")
    return join(a.nnodes, a.node_rank, a.master_addr, a.port, nproc=a.nproc, timeout_s=a.timeout,
                hosts=[h for h in a.hosts.split(",") if h])


if __name__ == "__main__":
    sys.exit(main())
