"""launch/ray/submit.py on a Ray cluster of two "nodes" on this machine: two raylets (`ray start --head` and a
second `ray start --address`), so a STRICT_SPREAD placement group really spreads over two Ray nodes. The tiny CPU
recipe runs at DP2, one torchrun per Ray node: SIGTERM to submit.py saves and exits 75, the same command resumes to
the end and exits 0, and every step is logged; a node whose trainer dies takes the job down (exit 1) with nothing
left running; too few nodes fail with a message naming what is missing.

The cluster is this module's alone: its own temp dir and ports, its `ray start`s in process groups of their own, and
a marker in the environment every process it starts inherits (raylets, Ray workers, torchruns, trainer ranks).
`ray stop --force` is not used: it stops every Ray cluster of this user on the machine, other tests' included; the
teardown kills the cluster's process groups and marked processes instead and checks that none is left. The fast
tests at the bottom check submit.py's arguments and messages and launch/ray/cluster.yaml, without a cluster."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Optional

import psutil
import pytest

from megappo.testing.prompts import metrics_so_far

from megappo.testing.dist import free_port

REPO = Path(__file__).resolve().parents[2]
SUBMIT = REPO / "launch" / "ray" / "submit.py"
MARKER = "MEGAPPO_RAY_TEST"
# steps of about 0.1 s: enough of them that a SIGTERM sent once step 1 is logged (through Ray to every node's
# ranks, which takes up to a second on a loaded machine) lands before the last step
STEPS = 20
TRAIN = ["train", "--config", "recipes/cpu/tiny_ppo.yaml", f"trainer.total_training_steps={STEPS}",
         f"trainer.test_freq={STEPS}", f"trainer.save_freq={STEPS}", "trainer.logger=[]",
         "data.synthetic.num_train_prompts=64",
         "data.synthetic.num_val_prompts=16", "data.train_batch_size=16",
         "actor_rollout_ref.actor.ppo_mini_batch_size=8", "trainer.nnodes=2", "trainer.n_gpus_per_node=1"]


def _load_submit():
    spec = importlib.util.spec_from_file_location("megappo_ray_submit", SUBMIT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ours(marker: str, groups: set[int]) -> list[psutil.Process]:
    """The cluster's processes: those in the process groups of its `ray start`s (Ray's agents among them), and any
    other with the marker in its environment (read raw: Ray's process titles overwrite what psutil parses)."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) in groups:
                found.append(p)
                continue
            with open(f"/proc/{p.pid}/environ", "rb") as f:
                if needle in f.read():
                    found.append(p)
        except (OSError, psutil.Error):
            pass
    return found


def _kill_cluster(marker: str, groups: set[int]) -> list[str]:
    """SIGKILL every process of the cluster; returns what was still there after it (nothing, normally)."""
    for _ in range(3):  # a raylet may start a worker while its siblings die
        procs = _ours(marker, groups)
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=10)
    left = []
    for p in _ours(marker, groups):
        try:
            left.append(f"{p.pid} {p.name()}")
        except psutil.NoSuchProcess:
            pass
    return left


@pytest.fixture(scope="module")
def cluster():
    # Ray's socket paths must fit in 107 characters: a short directory, not pytest's tmp_path
    tmp = Path(tempfile.mkdtemp(prefix="mpray", dir="/tmp"))
    marker = uuid.uuid4().hex
    home, scratch = tmp / "home", tmp / "t"
    home.mkdir()
    scratch.mkdir()
    # a fresh HOME: a ~/.ray/auth_token left by another Ray session makes a joining raylet fail authentication
    env = dict(os.environ, HOME=str(home), TMPDIR=str(scratch), RAY_USAGE_STATS_ENABLED="0", **{MARKER: marker},
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
               MEGAPPO_CPU_THREADS="1", OMP_NUM_THREADS="1")
    port = free_port()
    # the log monitor only forwards worker logs, which submit.py does not use (it drains each torchrun itself)
    common = ["--num-cpus", "1", "--object-store-memory", str(80 * 2**20), "--disable-usage-stats",
              "--include-log-monitor", "false",
              "--dashboard-agent-listen-port", "0", "--min-worker-port", "0", "--max-worker-port", "0"]
    head = ["ray", "start", "--head", "--port", str(port), "--temp-dir", str(tmp / "ray"), "--include-dashboard",
            "false", "--ray-client-server-port", str(free_port()), "--resources", '{"node0": 1}', *common]
    worker = ["ray", "start", "--address", f"127.0.0.1:{port}", "--resources", '{"node1": 1}', *common]
    groups: set[int] = set()
    try:
        for cmd in (head, worker):
            # its own session: the raylet, GCS and agents it leaves behind stay in that process group
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)
            groups.add(proc.pid)
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0, f"{' '.join(cmd)}:\n{out[-4000:]}"
        yield {"address": f"127.0.0.1:{port}", "env": env, "scratch": scratch}
    finally:
        left = _kill_cluster(marker, groups)
        shutil.rmtree(tmp, ignore_errors=True)
        assert not left, f"processes of the test's Ray cluster outlived it: {left}"


def _submit(cluster, args: list[str], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, str(SUBMIT), "--address", cluster["address"], "--start-timeout", "60",
           "--env", "MEGAPPO_CPU_THREADS=1", *args]
    with open(log, "a") as f:
        return subprocess.Popen(cmd, cwd=REPO, env=cluster["env"], stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _finish(proc: subprocess.Popen, log: Path, timeout: float) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"submit.py did not end within {timeout} s:\n{log.read_text()[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def _no_torchrun_left(out: Path) -> None:
    mine = []
    for p in psutil.process_iter():
        try:
            if any(str(out) in a for a in p.cmdline()):
                mine.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    assert not mine, f"left running after submit.py ended: {mine}"


@pytest.mark.e2e
@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_ray_nodes_train_preempt_and_resume(cluster, tmp_path):
    out, log = tmp_path / "run", tmp_path / "submit.log"
    command = ["--nodes", "2", "--nproc-per-node", "1", "--", *TRAIN, f"trainer.default_local_dir={out}"]
    proc = _submit(cluster, command, log)
    deadline = time.monotonic() + 180
    while proc.poll() is None and time.monotonic() < deadline and not any(r["step"] == 1 for r in metrics_so_far(out)):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # what a scheduler sends before preemption
    assert _finish(proc, log, 120) == 75, log.read_text()[-4000:]
    text = log.read_text()
    assert "run status preempted: exit 75" in text
    status = json.loads((out / "run_status.json").read_text())
    assert status["status"] == "preempted" and 1 <= status["step"] < STEPS, (status, text[-3000:])
    ckpt = out / "checkpoints" / f"global_step_{status['step']}"
    assert sorted(p.name for p in (ckpt / "rng").iterdir()) == ["rank_0.pt", "rank_1.pt"]
    _no_torchrun_left(out)

    # the same command continues from that checkpoint to the end
    proc = _submit(cluster, command, log)
    assert _finish(proc, log, 180) == 0, log.read_text()[-4000:]
    text = log.read_text()
    assert "[node 0] " in text and "[node 1] " in text  # both nodes' output came back, prefixed
    rows = metrics_so_far(out)
    assert [r["step"] for r in rows] == list(range(STEPS + 1)), text[-3000:]
    assert all(math.isfinite(r["reward/mean"]) and 0 <= r["reward/mean"] <= 1 for r in rows[1:])
    assert all(math.isfinite(r["actor/pg_loss"]) and math.isfinite(r["critic/vf_loss"]) for r in rows[1:])
    assert math.isfinite(rows[-1]["val/megappo/digit_max/reward_mean"])
    assert json.loads((out / "run_status.json").read_text())["status"] == "finished"
    _no_torchrun_left(out)
    assert not list(cluster["scratch"].glob("megappo-ray-*")), "submit.py left its status files behind"


def _rank_process(out: Path, rank: int) -> Optional[psutil.Process]:
    for p in psutil.process_iter():
        try:
            if any(str(out) in a for a in p.cmdline()) and "megappo.cli" in p.cmdline() and \
                    p.environ().get("RANK") == str(rank):
                return p
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return None


@pytest.mark.e2e
@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.long  # the preempt-and-resume test covers the launcher end to end
def test_a_node_that_dies_takes_the_job_down(cluster, tmp_path):
    out, log = tmp_path / "run", tmp_path / "submit.log"
    proc = _submit(cluster, ["--nodes", "2", "--nproc-per-node", "1", "--kill-grace", "5", "--", *TRAIN,
                             "trainer.total_training_steps=50", f"trainer.default_local_dir={out}"], log)
    deadline = time.monotonic() + 180
    while proc.poll() is None and time.monotonic() < deadline and not metrics_so_far(out):
        time.sleep(0.1)
    victim = _rank_process(out, 1)
    assert victim is not None, log.read_text()[-4000:]
    victim.kill()  # a node's trainer dies (OOM killer, hardware): rank 0 is left waiting in a collective
    assert _finish(proc, log, 90) == 1, log.read_text()[-4000:]
    text = log.read_text()
    # the first node to fail starts the others' grace period; whoever is still running after it is killed
    assert re.search(r"submit: node [01] exited with -?\d+; the others have 5 s to end", text), text[-4000:]
    assert "run status None: exit 1" in text
    _no_torchrun_left(out)


@pytest.mark.e2e
@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_more_nodes_than_the_cluster_has_names_what_is_missing(cluster, tmp_path):
    log = tmp_path / "submit.log"
    proc = _submit(cluster, ["--nodes", "3", "--nproc-per-node", "1", "--start-timeout", "3", "--", *TRAIN], log)
    assert _finish(proc, log, 90) == 1
    text = log.read_text()
    assert "not ready after 3 s: it needs 3 distinct nodes with CPU=1 each" in text, text[-3000:]
    assert "the cluster has 2 alive node(s), 2 large enough" in text
    assert "missing: 1 more node(s) with CPU=1" in text


# ---------------------------------------------------------------------------------------------------------------
# fast: submit.py's arguments and messages, no cluster
# ---------------------------------------------------------------------------------------------------------------
def test_arguments_split_at_the_double_dash():
    submit = _load_submit()
    args, command = submit.parse_args(["--nodes", "2", "--nproc-per-node", "4", "--gpus-per-node", "4", "--env",
                                       "A=b=c", "--", "train", "--config", "x.yaml", "--nodes", "k=v"])
    assert (args.nodes, args.nproc_per_node, args.address, args.env) == (2, 4, "auto", ["A=b=c"])
    assert command == ["train", "--config", "x.yaml", "--nodes", "k=v"]  # after `--`: megappo's, untouched
    assert submit.bundle(args) == {"CPU": 1, "GPU": 4}
    assert submit.torchrun_args(2, 1, "10.0.0.1", 29400, 4, command) == [
        "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29400",
        "--nproc-per-node", "4", "-m", "megappo.cli", *command]


@pytest.mark.parametrize("argv, message", [
    (["--nodes", "2", "--nproc-per-node", "1"], "give the megappo command after `--`"),
    (["--nodes", "2", "--nproc-per-node", "1", "--"], "give the megappo command after `--`"),
    (["--nodes", "0", "--nproc-per-node", "1", "--", "train"], "--nodes must be >= 1"),
    (["--nodes", "1", "--nproc-per-node", "0", "--", "train"], "--nproc-per-node must be >= 1"),
    (["--nproc-per-node", "1", "--", "train"], "the following arguments are required: --nodes"),
    (["--nodes", "1", "--nproc-per-node", "1", "--env", "NOVALUE", "--", "train"], "--env takes KEY=VALUE"),
])
def test_bad_arguments_say_what_to_fix(argv, message, capsys):
    submit = _load_submit()
    with pytest.raises(SystemExit) as e:
        submit.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_placement_group_message_names_the_missing_resources():
    submit = _load_submit()
    nodes = [{"Alive": True, "NodeID": "a" * 56, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 8, "GPU": 8}},
             {"Alive": True, "NodeID": "b" * 56, "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 8, "GPU": 4}},
             {"Alive": False, "NodeID": "c" * 56, "NodeManagerAddress": "10.0.0.3", "Resources": {"CPU": 8, "GPU": 8}}]
    text = submit.missing_resources({"CPU": 4, "GPU": 8}, 2, nodes, 60)
    assert "needs 2 distinct nodes with CPU=4, GPU=8 each" in text
    assert "2 alive node(s), 1 large enough" in text
    assert "10.0.0.2" in text and "GPU 4<8" in text and "10.0.0.3" not in text
    assert "missing: 1 more node(s) with CPU=4, GPU=8" in text
    busy = submit.missing_resources({"CPU": 4}, 2, nodes, 60)
    assert "other jobs hold their resources" in busy


def test_cluster_config_is_valid_for_ray_up():
    """launch/ray/cluster.yaml passes the checks `ray up` runs first (Ray's own schema), runs the project's image,
    starts Ray on the head and the workers, and holds no secret."""
    import yaml
    from ray.autoscaler._private.util import prepare_config, validate_config

    text = (REPO / "launch" / "ray" / "cluster.yaml").read_text()
    config = yaml.safe_load(text)
    validate_config(prepare_config(config))
    version = re.search(r'version="([^"]+)"', (REPO / "setup.py").read_text()).group(1)
    assert config["docker"]["image"].endswith(f"/megappo:{version}")
    assert "--gpus all" in config["docker"]["run_options"]
    assert any("ray start --head" in c for c in config["head_start_ray_commands"])
    assert any("ray start --address=$RAY_HEAD_IP" in c for c in config["worker_start_ray_commands"])
    assert config["auth"]["ssh_private_key"].startswith("~/")  # a path on the launching machine, not a key
    assert not re.search(r"(?i)(password|secret|token|aws_access_key|BEGIN [A-Z ]*PRIVATE KEY)\s*[:=]", text)


@pytest.mark.parametrize("rcs, status, code", [
    ([0, 0], "finished", 0), ([0, 0], None, 0),  # a command that writes no status (convert) succeeded
    ([1, 1], "preempted", 75), ([1, 0], "stopped", 3),
    ([1, 1], None, 1), ([0, 1], "finished", 1),  # a node failed after the trainer finished: still a failure
])
def test_exit_status_is_the_trainers(rcs, status, code):
    assert _load_submit().exit_status(rcs, status) == code
