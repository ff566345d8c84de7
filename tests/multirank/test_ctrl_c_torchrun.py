"""Ctrl-C in the terminal of a 2-rank run under launch/torchrun.sh: the script passes it on to every rank (torchrun
ignores it), the ranks agree to stop after the same step, save it, and the script exits 75 as the ranks did;
neither torchrun nor a rank prints a SignalException or KeyboardInterrupt."""
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

from megappo.testing.prompts import metrics_so_far

pytestmark = [pytest.mark.multirank, pytest.mark.e2e, pytest.mark.timeout(300)]
REPO = Path(__file__).resolve().parents[2]


# long (about a minute): SIGTERM to torchrun's ranks is tests/multirank/test_preemption_multirank.py's, Ctrl-C to one
# rank tests/e2e/test_resume_exact.py's
@pytest.mark.long
def test_ctrl_c_under_torchrun_sh_saves_on_every_rank_and_exits_75(tmp_path):
    out, log = tmp_path / "run", tmp_path / "run.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")
           and k not in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE")}
    env.update(PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""), MEGAPPO_CPU_THREADS="1")
    cmd = ["bash", str(REPO / "launch" / "torchrun.sh"), "--nproc-per-node", "2", "train", "--config",
           "recipes/cpu/tiny_ppo.yaml", "trainer.n_gpus_per_node=2", f"trainer.default_local_dir={out}",
           "trainer.total_training_steps=200", "trainer.save_freq=100", "trainer.logger=[]"]
    with open(log, "w") as f:  # its own session and process group: the terminal's foreground job
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 200
        while (proc.poll() is None and time.monotonic() < deadline
               and not any(r["step"] == 1 for r in metrics_so_far(out))):
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the script and torchrun, not the ranks' sessions
        assert proc.wait(120) == 75, log.read_text()[-4000:]
    finally:
        for child in psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []:
            child.kill()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    text = log.read_text()
    assert "SignalException" not in text and "KeyboardInterrupt" not in text, text[-4000:]
    assert text.count("megappo train: Ctrl-C: finishing this step") == 1  # rank 0 says it
    status = json.loads((out / "run_status.json").read_text())
    assert status["status"] == "preempted" and "SIGINT" in status["reason"]
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == str(status["step"])
