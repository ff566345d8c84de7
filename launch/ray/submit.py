#!/usr/bin/env python
"""Run a `megappo` command on an existing Ray cluster: one torchrun per node, one node per placement-group bundle.

    python launch/ray/submit.py --nodes 2 --nproc-per-node 8 --gpus-per-node 8 [--address auto] \\
        -- train --config recipes/gsm8k/qwen2.5-7b_ppo_tp4pp2.yaml trainer.nnodes=2 trainer.n_gpus_per_node=8

Ray only places processes: a STRICT_SPREAD placement group reserves one bundle (--cpus-per-node, --gpus-per-node)
on each of N distinct Ray nodes and an actor in each starts `torchrun --nnodes N --node-rank i --master-addr <node 0>
--master-port <free on node 0> -m megappo.cli ...`, so the trainer is the same SPMD program as under Slurm. Every node
needs this checkout (or the image's /opt/megappo) at --workdir and megappo in the Python of Ray's workers.

Output: every node's lines, prefixed `[node i]`. Exit status: the trainer's (0 finished, 3 stopped by the KL guard or
the reward watch, 75 preempted: run the same command again; torchrun itself says 1 for all of them, so each node's
trainer writes it into a fresh $MEGAPPO_STATUS_FILE), else 1. Ctrl-C or SIGTERM asks every node to save and stop
(exit 75); a second one kills them. When a node fails, the others get --kill-grace seconds to end, then are killed.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Optional

EXIT_STATUS = {"finished": 0, "stopped": 3, "preempted": 75}  # the trainer's status file -> `megappo train`'s exit
SIGNALS: list[int] = []  # SIGINT/SIGTERM received by this driver, in order


class LaunchError(RuntimeError):
    """The job could not start: the message says what is missing."""


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(options, megappo command): the command is everything after `--`."""
    parser = argparse.ArgumentParser(prog="submit.py", description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s --nodes N --nproc-per-node K [options] -- MEGAPPO_ARGS...")
    parser.add_argument("--nodes", type=int, required=True, help="Ray nodes to run on (torchrun --nnodes)")
    parser.add_argument("--nproc-per-node", type=int, required=True, help="ranks per node (torchrun's)")
    parser.add_argument("--gpus-per-node", type=int, default=0,
                        help="GPUs reserved per node (default 0; Ray hides the GPUs it did not reserve)")
    parser.add_argument("--cpus-per-node", type=float, default=1, help="CPUs reserved per node (default 1)")
    parser.add_argument("--address", default="auto", help="Ray cluster address (default auto: the local one)")
    parser.add_argument("--workdir", default=os.getcwd(), help="directory to run in on every node (default: here)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment for torchrun on every node (repeat; OMP_NUM_THREADS defaults to 1)")
    parser.add_argument("--start-timeout", type=float, default=300, help="seconds to get every node started")
    parser.add_argument("--kill-grace", type=float, default=30,
                        help="seconds the other nodes get to end after one fails, before they are killed")
    cut = argv.index("--") if "--" in argv else len(argv)
    args, command = parser.parse_args(argv[:cut]), argv[cut + 1:]
    problems = [("give the megappo command after `--`, e.g. -- train --config recipes/cpu/tiny_ppo.yaml", not command),
                ("--nodes must be >= 1", args.nodes < 1), ("--nproc-per-node must be >= 1", args.nproc_per_node < 1),
                ("--gpus-per-node and --cpus-per-node must be >= 0", min(args.gpus_per_node, args.cpus_per_node) < 0),
                (f"--env takes KEY=VALUE, got {args.env}", any("=" not in e or e.startswith("=") for e in args.env))]
    for message, bad in problems:
        if bad:
            parser.error(message)
    return args, command


def bundle(args: argparse.Namespace) -> dict[str, float]:
    return {"CPU": args.cpus_per_node, **({"GPU": args.gpus_per_node} if args.gpus_per_node else {})}


def torchrun_args(nodes: int, rank: int, addr: str, port: int, nproc: int, command: list[str]) -> list[str]:
    return ["--nnodes", str(nodes), "--node-rank", str(rank), "--master-addr", addr, "--master-port", str(port),
            "--nproc-per-node", str(nproc), "-m", "megappo.cli", *command]


def missing_resources(want: dict[str, float], count: int, nodes: list[dict], timeout: float) -> str:
    """Why a STRICT_SPREAD group of `count` bundles `want` is not ready: what each node lacks, what is missing."""
    alive = [n for n in nodes if n.get("Alive")]
    need = ", ".join(f"{k}={v:g}" for k, v in want.items())
    lines, fit = [], 0
    for n in alive:
        res = n.get("Resources", {})
        short = [f"{k} {res.get(k, 0):g}<{v:g}" for k, v in want.items() if res.get(k, 0) < v]
        fit += not short
        lines.append(f"  node {n.get('NodeID', '?')[:8]} at {n.get('NodeManagerAddress', '?')}: "
                     + (", ".join(short) or "fits"))
    lines.insert(0, f"the placement group was not ready after {timeout:g} s: it needs {count} distinct nodes with "
                    f"{need} each (STRICT_SPREAD, one bundle per node); the cluster has {len(alive)} alive node(s), "
                    f"{fit} large enough")
    lines.append(f"missing: {count - fit} more node(s) with {need}; add workers or lower --nodes, --cpus-per-node, "
                 "--gpus-per-node" if fit < count else
                 "enough nodes are large enough: other jobs hold their resources (`ray status` shows them)")
    return "\n".join(lines)


def exit_status(rcs: list[int], status: Optional[str]) -> int:
    """The job's exit status from every torchrun's and the trainer's own status (None: it wrote none)."""
    if status in EXIT_STATUS and (status != "finished" or not any(rcs)):
        return EXIT_STATUS[status]
    return 1 if any(rcs) else 0


class NodeRunner:
    """One node's torchrun: started in its own session, output kept for the driver to drain, killed as a tree."""

    def __init__(self, rank: int, workdir: str):
        import tempfile
        from collections import deque

        self.rank, self.proc, self.lines = rank, None, deque()
        os.chdir(workdir)  # this actor's process is ours alone; relative recipe and output paths resolve here
        # the trainer writes how it ended here (local rank 0 of each node): a fresh file, never an earlier run's
        self.status_file = os.path.join(tempfile.mkdtemp(prefix="megappo-ray-"), "status.json")

    def __repr__(self) -> str:  # Ray's prefix for this actor's own log lines
        return f"node{self.rank}"

    def hello(self) -> tuple[str, int]:
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def start(self, torchrun: list[str], env: dict[str, str]) -> int:
        import subprocess
        import threading

        # torchrun from this node's Python, SIGTERMed when this actor dies (it passes that on to its workers). The
        # actor runs its methods on its main thread (max_concurrency 1), which lives as long as the actor.
        self.proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *torchrun],
                                     env={**os.environ, **env, "MEGAPPO_STATUS_FILE": self.status_file},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        self.pump = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.pump.start()
        return self.proc.pid

    def drain(self) -> tuple[list[str], Optional[int], Optional[str]]:
        """New output lines; once torchrun ended and its output is all read, its exit status and how the trainer
        ended on this node (finished, preempted, stopped; None if it did not get that far)."""
        import json

        done = self.proc.poll() is not None and not self.pump.is_alive()
        lines, status = [self.lines.popleft() for _ in range(len(self.lines))], None
        if done and os.path.exists(self.status_file):
            with open(self.status_file) as f:
                status = json.load(f).get("status")
        return lines, (self.proc.returncode if done else None), status

    def signal(self, sig: int) -> None:
        """SIGKILL: the whole tree (workers run in their own sessions: a process group would miss them). Another
        signal: the workers alone, as launch/torchrun.sh does: torchrun would kill their process groups (a
        checkpoint writer's helper processes included) and SIGKILL them 30 s later; with no workers yet, the tree."""
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            targets = root.children()
            if sig == signal.SIGKILL or not targets:
                sig, targets = signal.SIGKILL, root.children(recursive=True) + [root]
        except psutil.NoSuchProcess:
            return
        for p in targets:
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass

    def stop(self) -> None:
        """Kill whatever is left and remove the status file's directory: the job is over."""
        import shutil

        if self.proc is not None:
            self.signal(signal.SIGKILL)
        shutil.rmtree(os.path.dirname(self.status_file), ignore_errors=True)


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _late(refs: list, timeout: float) -> list[int]:
    """Wait for refs up to `timeout`; the indices of those not ready. A signal ends the wait with an error."""
    import ray

    ready: list = []
    deadline = time.monotonic() + timeout
    while len(ready) < len(refs) and time.monotonic() < deadline and not SIGNALS:
        ready = ray.wait(refs, num_returns=len(refs), timeout=min(1.0, max(deadline - time.monotonic(), 0)))[0]
    if SIGNALS:
        raise LaunchError(f"{signal.Signals(SIGNALS[0]).name} while starting: stopped")
    return [i for i, r in enumerate(refs) if r not in ready]


def _on_every_node(refs: list, what: str, timeout: float) -> list:
    import ray

    if late := _late(refs, timeout):
        raise LaunchError(f"node(s) {late} did not {what} within {timeout:g} s (`ray status` and those nodes' Ray "
                          "logs say why)")
    return ray.get(refs)


def _watch(runners: list, kill_grace: float) -> tuple[list[int], Optional[str]]:
    """Stream every node's output until every torchrun ended, passing signals on. Returns their exit statuses and
    how the trainer ended."""
    import ray

    n, rcs, statuses, handled, kill_at = len(runners), {}, [], 0, float("inf")

    def send(sig: int) -> None:
        ray.get([r.signal.remote(sig) for i, r in enumerate(runners) if i not in rcs])

    while len(rcs) < n:
        if len(SIGNALS) > handled:
            handled = len(SIGNALS)
            print(f"submit: {signal.Signals(SIGNALS[-1]).name}: " + ("every node saves and stops (again to kill)"
                  if handled == 1 else "killing every node"), file=sys.stderr, flush=True)
            send(signal.SIGTERM if handled == 1 else signal.SIGKILL)
        if time.monotonic() > kill_at:
            print("submit: killing the nodes still running", file=sys.stderr, flush=True)
            send(signal.SIGKILL)
            kill_at = float("inf")
        for i, ref in [(i, r.drain.remote()) for i, r in enumerate(runners) if i not in rcs]:
            try:
                lines, rc, status = ray.get(ref, timeout=60)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                lines, rc, status = [f"submit: node {i} lost: {type(e).__name__}\n"], 1, None
            sys.stdout.writelines(f"[node {i}] {line}" for line in lines)
            if rc is None:
                continue
            rcs[i] = rc
            statuses.append(status)
            # a failure, not the job ending on purpose (a signal, a deadline, the KL guard): the other nodes would
            # wait for it in a collective
            if rc and len(rcs) < n and not handled and kill_at == float("inf") and \
                    status not in ("preempted", "stopped"):
                print(f"submit: node {i} exited with {rc}; the others have {kill_grace:g} s to end",
                      file=sys.stderr, flush=True)
                kill_at = time.monotonic() + kill_grace
        sys.stdout.flush()
        time.sleep(0.2)
    return [rcs[i] for i in range(n)], next((s for s in statuses if s), None)


def run(args: argparse.Namespace, command: list[str]) -> int:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ray.init(address=args.address, log_to_driver=False)  # each node's output comes back through drain()
    want, n = bundle(args), args.nodes
    pg = placement_group([want] * n, strategy="STRICT_SPREAD")
    runners: list = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, _f: SIGNALS.append(s))
    try:
        if _late([pg.ready()], args.start_timeout):
            raise LaunchError(missing_resources(want, n, ray.nodes(), args.start_timeout))
        actor = ray.remote(NodeRunner)
        runners = [actor.options(num_cpus=want["CPU"], num_gpus=want.get("GPU", 0),
                                 scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i)).remote(i, args.workdir)
                   for i in range(n)]
        addr, port = _on_every_node([r.hello.remote() for r in runners], "start", args.start_timeout)[0]
        env = dict(e.split("=", 1) for e in ["OMP_NUM_THREADS=1", *args.env])
        _on_every_node([r.start.remote(torchrun_args(n, i, addr, port, args.nproc_per_node, command), env)
                        for i, r in enumerate(runners)], "start torchrun", args.start_timeout)
        print(f"submit: {n} node(s) started, rendezvous at {addr}:{port}", flush=True)
        rcs, status = _watch(runners, args.kill_grace)
        code = exit_status(rcs, status)
        print(f"submit: torchrun exit status by node {rcs}, run status {status}: exit {code}", flush=True)
        return code
    finally:
        # whatever ended the job, no torchrun outlives it (an actor already gone took its torchrun along)
        if runners:
            ray.wait([r.stop.remote() for r in runners], num_returns=n, timeout=30)
        for r in runners:
            ray.kill(r)
        remove_placement_group(pg)


def main(argv: Optional[list[str]] = None) -> int:
    args, command = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return run(args, command)
    except ConnectionError as e:  # ray.init found no cluster
        print(f"submit: no Ray cluster at --address {args.address} ({e}); start one with `ray up "
              "launch/ray/cluster.yaml` or `ray start --head`", file=sys.stderr)
        return 1
    except LaunchError as e:
        print(f"submit: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
