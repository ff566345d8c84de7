"""A real Slurm cluster on this machine for the launch tests: munged with its own key and socket, slurmctld, and two
slurmd daemons posing as nodes n1 and n2 (Slurm's multiple-slurmd mode: both run here, at 127.0.0.1), all under a
temporary directory. Skipped with the reason when Slurm is not installed (`apt-get install slurm-wlm munge`), we
are not root, or the daemons do not come up. At the end every job is cancelled, the daemons are stopped, and any
process they or the jobs started is killed: each carries a marker in its environment."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from megappo.testing.dist import free_port

NODES = ("n1", "n2")
BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "slurmstepd", "sbatch", "srun", "scontrol", "scancel",
            "squeue", "sinfo")
MARKER = "MEGAPPO_TEST_SLURM"  # in the environment of everything the cluster runs
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE"}
# what an outer allocation or the developer's shell would otherwise leak into the jobs' layout
LAYOUT_VARS = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE", "GPUS_PER_NODE", "MEGAPPO_HOME",
               "MEGAPPO_VENV", "MEGAPPO_STATUS_FILE")

SLURM_CONF = """\
ClusterName=megappotest
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also delays a requeued job's next start (cred_expire + 1 s; default 120 s)
AuthInfo=socket={root}/munge.sock,cred_expire=10
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
JobRequeue=1
KillWait=10
{node_lines}
# preemption as clusters configure it: a job of the urgent partition requeues debug's jobs on its nodes, which get
# SIGTERM from slurmd and GraceTime seconds before SIGKILL
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
PartitionName=debug Nodes={nodes} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=60
PartitionName=urgent Nodes={nodes} MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
"""


@dataclass
class Slurm:
    root: Path
    env: dict[str, str]  # for Slurm's commands and the jobs they submit: SLURM_CONF and the marker
    daemons: list[subprocess.Popen] = field(default_factory=list)

    def run(self, *cmd: str, timeout: float = 30, check: bool = True, **kw) -> subprocess.CompletedProcess:
        kw.setdefault("env", self.env)
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=check, **kw)

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`'s fields (JobState, Restarts, ExitCode, ...)."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(tok.split("=", 1) for tok in out.split() if "=" in tok)

    def wait_job(self, job_id: str, timeout: float) -> dict[str, str]:
        """The job's fields once it has ended for good (a requeued job runs again first)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in FINISHED:
                return info
            time.sleep(0.5)
        self.run("scancel", job_id, check=False)
        raise AssertionError(f"job {job_id} did not end within {timeout} s: {self.job(job_id)}")

    def leftovers(self) -> list[str]:
        """Processes started by this cluster's jobs (slurmstepd included), not the daemons (nor slurmctld's
        slurmscriptd)."""
        daemons = {p.pid for p in self.daemons}
        return [f"{pid} {cmd}" for pid, cmd in _marked(str(self.root))
                if pid not in daemons and _parent(pid) not in daemons]

    def wait_no_leftovers(self, timeout: float = 20) -> None:
        """Everything a finished job started is gone (slurmstepd included) within `timeout`."""
        deadline = time.monotonic() + timeout
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"still running after the job ended: {left}"

    def log_tails(self) -> str:
        return "\n".join(f"--- {p.name}:\n{p.read_text(errors='replace')[-2000:]}"
                         for p in sorted((self.root / "log").glob("*")) if p.is_file())


def _marked(root: str) -> list[tuple[int, str]]:
    """(pid, command line) of every process whose environment carries MARKER=root."""
    needle = f"{MARKER}={root}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:  # gone, or not ours to read
            continue
        found.append((int(entry.name), cmd))
    return found


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _poll(what: str, ready, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.2)
    raise TimeoutError(f"{what} not ready after {timeout} s")


def _nodes_idle(cluster: Slurm) -> bool:
    lines = cluster.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.splitlines()
    return {line.split()[0] for line in lines if line.split()[1:] == ["idle"]} == set(NODES)  # a line per partition


def _stop(cluster: Slurm) -> None:
    """Cancel every job, stop the daemons, kill whatever is left of them and of the jobs, remove the state."""
    try:
        ids = cluster.run("squeue", "-h", "-o", "%i", check=False, timeout=10).stdout.split()
        if ids:
            cluster.run("scancel", *ids, check=False, timeout=10)
            _poll("job cancellation", lambda: not cluster.run("squeue", "-h", check=False, timeout=10).stdout.strip(),
                  30)
    except (subprocess.SubprocessError, OSError, TimeoutError):
        pass  # the daemons may be the ones that failed: stopped below either way
    for proc in reversed(cluster.daemons):  # slurmd before slurmctld before munged
        if proc.poll() is None:
            proc.terminate()
    for proc in cluster.daemons:
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    for pid, _cmd in _marked(str(cluster.root)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(cluster.root, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory) -> Slurm:
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} not found): "
                    "apt-get install -y --no-install-recommends slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster runs its daemons as root (SlurmUser=root, slurmd starts jobs as root)")
    # munge's socket path must fit in a sockaddr_un (108 bytes): pytest's temporary directories do
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "log"):
        (root / sub).mkdir()
    host = socket.gethostname().split(".")[0]
    ports = [free_port() for _ in range(1 + len(NODES))]
    conf = root / "slurm.conf"
    # both "nodes" are this machine, each with all its CPUs, told apart by their slurmd's port
    node_lines = "\n".join(f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} "
                           f"CPUs={os.cpu_count() or 1} RealMemory=1000 State=UNKNOWN"
                           for node, port in zip(NODES, ports[1:]))
    conf.write_text(SLURM_CONF.format(host=host, root=root, ctld_port=ports[0], node_lines=node_lines,
                                      nodes=",".join(NODES)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in LAYOUT_VARS}
    env.update(SLURM_CONF=str(conf), **{MARKER: str(root)})
    cluster = Slurm(root, env)

    def daemon(name: str, *cmd: str) -> None:
        with open(root / "log" / f"{name}.out", "w") as log:
            cluster.daemons.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                    stdin=subprocess.DEVNULL, start_new_session=True))

    try:
        key = root / "munge.key"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True, timeout=30)
        # --force: munged refuses a socket directory others can write to (/tmp) without it
        daemon("munged", "munged", "--foreground", "--force", f"--socket={root}/munge.sock", f"--key-file={key}",
               f"--pid-file={root}/munged.pid", f"--seed-file={root}/munged.seed", f"--log-file={root}/log/munged.log")
        _poll("munged", lambda: (root / "munge.sock").exists(), 15)
        daemon("slurmctld", "slurmctld", "-D", "-i", "-f", str(conf))
        _poll("slurmctld", lambda: cluster.run("scontrol", "ping", check=False).returncode == 0, 30)
        for node in NODES:
            daemon(f"slurmd-{node}", "slurmd", "-D", "-N", node, "-f", str(conf))
        _poll("both nodes", lambda: _nodes_idle(cluster), 60)
    except (subprocess.SubprocessError, OSError, TimeoutError) as e:
        tails = cluster.log_tails()
        _stop(cluster)
        pytest.skip(f"could not start a local Slurm cluster ({e}):\n{tails}")
    try:
        yield cluster
    finally:
        _stop(cluster)
