"""Two "nodes" on one machine: `launch/torchrun.sh` started twice with NNODES=2, NODE_RANK=0/1 and one rank each,
meeting at MASTER_ADDR=127.0.0.1:MASTER_PORT, runs the tiny CPU recipe at DP2 and logs exactly the metrics, and ends
at exactly the weights, of the same layout on one node (one torchrun with two ranks). On CPU with one thread per rank
the trainer is deterministic, so "exactly" means bit for bit, timing aside. (Which node gets rank 0 is the
rendezvous' choice; the numbers do not depend on it.)"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from megappo.testing.dist import free_port_run
from megappo.testing.prompts import assert_same_rows, metrics_so_far

pytestmark = [pytest.mark.multirank, pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(420)]
REPO = Path(__file__).resolve().parents[2]
LAUNCH = str(REPO / "launch" / "torchrun.sh")
STEPS = 3
OVERRIDES = [f"trainer.total_training_steps={STEPS}", "trainer.test_freq=3", "trainer.save_freq=3",
             "trainer.logger=[]", "data.synthetic.num_train_prompts=64", "data.synthetic.num_val_prompts=16",
             "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=8"]
TIMEOUT = 180


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE")
           and not k.startswith("SLURM_")}  # torchrun.sh prefers Slurm's view of the job when it sees one
    # torchrun.sh calls `torchrun` from PATH: this interpreter's
    env.update(PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""), HOME=str(home),
               HF_HOME=str(home / "hf"), MEGAPPO_CPU_THREADS="1", OMP_NUM_THREADS="1", **extra)
    return env


def _launch(out: Path, env: dict[str, str], log: Path, layout: list[str]) -> subprocess.Popen:
    cmd = ["bash", LAUNCH, "train", "--config", "recipes/cpu/tiny_ppo.yaml", f"trainer.default_local_dir={out}",
           *OVERRIDES, *layout]
    with open(log, "w") as f:
        # its own session: the whole torchrun tree is killed by process group, whatever happens to the test
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_all(procs: dict[str, tuple[subprocess.Popen, Path]]) -> None:
    """Wait for every process; on a failure or the deadline kill them all and fail with their logs."""
    deadline = time.monotonic() + TIMEOUT
    try:
        while any(p.poll() is None for p, _ in procs.values()):
            failed = [name for name, (p, _) in procs.items() if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        bad = {name: p.poll() for name, (p, _) in procs.items() if p.poll() != 0}
        logs = "\n".join(f"--- {name} (exit {p.poll()}):\n{log.read_text()[-3000:]}" for name, (p, log) in procs.items())
        assert not bad, f"{bad} did not finish within {TIMEOUT} s or failed:\n{logs}"
    finally:
        for p, _ in procs.values():  # nothing of a run outlives the test
            try:
                # torchrun's workers run in sessions of their own: the process group alone would miss them
                children = psutil.Process(p.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                children = []
            for child in children:
                try:
                    child.kill()
                except psutil.NoSuchProcess:
                    pass
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(30)


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_two_nodes_log_exactly_what_one_node_logs(tmp_path):
    one, two = tmp_path / "one_node", tmp_path / "two_nodes"
    # one node, two ranks (torchrun.sh's --standalone rendezvous)
    _wait_all({"one node": (_launch(one, _env(tmp_path, NPROC_PER_NODE="2"), tmp_path / "one.log",
                                    ["trainer.nnodes=1", "trainer.n_gpus_per_node=2"]), tmp_path / "one.log")})
    # two nodes of one rank each, rendezvous at node 0
    port = str(free_port_run(2))  # MASTER_PORT and the join check's MASTER_PORT+1
    nodes = {}
    for rank in (0, 1):
        env = _env(tmp_path, NNODES="2", NODE_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   NPROC_PER_NODE="1")
        log = tmp_path / f"node{rank}.log"
        nodes[f"node {rank}"] = (_launch(two, env, log, ["trainer.nnodes=2", "trainer.n_gpus_per_node=1"]), log)
    _wait_all(nodes)

    # both runs really were two ranks: every rank's RNG state is in the last checkpoint
    for out in (one, two):
        ckpt = out / "checkpoints" / f"global_step_{STEPS}"
        assert sorted(p.name for p in (ckpt / "rng").iterdir()) == ["rank_0.pt", "rank_1.pt"]
        assert json.loads((out / "run_status.json").read_text())["status"] == "finished"
    expected, got = metrics_so_far(one), metrics_so_far(two)
    assert [r["step"] for r in got] == [r["step"] for r in expected] == list(range(STEPS + 1))
    assert "reward/mean" in expected[-1] and "val/megappo/digit_max/reward_mean" in expected[-1]
    assert_same_rows(expected, got)
    a, b = _weights(one / "hf" / "actor"), _weights(two / "hf" / "actor")
    assert a and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the launcher said who joined before torchrun started
    assert "megappo join: all 2 nodes joined" in (tmp_path / "node0.log").read_text()


def test_a_node_that_never_joins_is_named(tmp_path):
    """Node 0 of two starts alone: within MEGAPPO_JOIN_TIMEOUT it exits 2 naming node rank 1 (torchrun alone would
    wait 15 minutes and then count the nodes); alone, node 1 names the address it could not reach."""
    port = str(free_port_run(2))  # MASTER_PORT and the join check's MASTER_PORT+1
    out = tmp_path / "run"
    t0 = time.monotonic()
    for rank, expect in ((0, "node rank(s) 1 of 2 did not join within 3 s"),
                         (1, f"node 1 could not reach node 0 at 127.0.0.1:{int(port) + 1} within 3 s")):
        env = _env(tmp_path, NNODES="2", NODE_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   NPROC_PER_NODE="1", MEGAPPO_JOIN_TIMEOUT="3")
        log = tmp_path / f"node{rank}.log"
        proc = _launch(out, env, log, ["trainer.nnodes=2", "trainer.n_gpus_per_node=1"])
        assert proc.wait(60) == 2, log.read_text()[-3000:]
        text = log.read_text()
        assert expect in text, text[-3000:]
        assert "Traceback" not in text and "frame #" not in text  # one line, not torch's C++ stack
    assert time.monotonic() - t0 < 45
    assert not out.exists()  # nothing started
