"""The step-0 checkpoint (the KL guard's, written before any optimizer state exists) at TP2 x PP2 on 4 gloo ranks
under the distributed optimizer: a run SIGKILLed in step 1 resumes from it to the uninterrupted run's metrics and
weights, and the guard rolls a first step back to it and retries that step exactly (scale factors of 1)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megappo.testing.dist import free_port
from megappo.testing.prompts import (assert_same_rows, metrics_so_far, read_metrics, tiny_run_overrides,
                                     write_prompt_parquet)

pytestmark = [pytest.mark.multirank, pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]
STEPS = 2
LAYOUT = ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
          "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
          "actor_rollout_ref.actor.megatron.use_distributed_optimizer=true", "trainer.n_gpus_per_node=4",
          "actor_rollout_ref.actor.optim.lr=1e-3", "critic.optim.lr=1e-3", "trainer.save_freq=10",
          "actor_rollout_ref.actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4",
          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null", "critic.ppo_micro_batch_size_per_gpu=null"]


@pytest.fixture(scope="module")
def data(tmp_path_factory, hf_model_dir):
    d = tmp_path_factory.mktemp("fresh_layout_data")
    return {"model": hf_model_dir("qwen2"), "train": write_prompt_parquet(str(d / "train.parquet"), 16)}


def _start(data, out: Path, extra=()) -> subprocess.Popen:
    overrides = tiny_run_overrides(str(out), data["model"], data["train"], steps=STEPS, extra=[*LAYOUT, *extra])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", f"--master-port={free_port()}",
           "-m", "megappo.cli", "train", "--config", "gsm8k/tiny_cpu", *overrides]
    out.mkdir(parents=True, exist_ok=True)
    log = open(out.parent / f"{out.name}.log", "w")
    return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))


def _finish(proc: subprocess.Popen, out: Path, timeout: float = 300) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"torchrun timed out:\n{(out.parent / f'{out.name}.log').read_text()[-4000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # nothing of the run outlives the test
        except ProcessLookupError:
            pass


def _log(out: Path) -> str:
    return (out.parent / f"{out.name}.log").read_text()[-6000:]


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


# ~65 s: a SIGKILL'd run resuming from the step-0 checkpoint is tests/e2e/test_fresh_optimizer_resume.py's on one rank,
# and the distributed optimizer's empty state at TP2 x PP2 is this file's guard test's: the long tier
@pytest.mark.long
def test_sigkill_in_step_1_resumes_from_the_step_0_checkpoint_exactly(data, tmp_path):
    ref = tmp_path / "uninterrupted"
    assert _finish(_start(data, ref), ref) == 0, _log(ref)

    out = tmp_path / "killed"
    proc = _start(data, out)
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline and not metrics_so_far(out):
        time.sleep(0.01)
    assert proc.poll() is None, _log(out)
    os.killpg(proc.pid, signal.SIGKILL)  # all four ranks and torchrun, in step 2 (or the end of step 1)
    _finish(proc, out)
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "0"

    assert _finish(_start(data, out), out) == 0, _log(out)
    assert_same_rows(read_metrics(str(ref)), read_metrics(str(out)), ignore=("guard/",))
    a, b = _weights(ref / "hf" / "actor"), _weights(out / "hf" / "actor")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_guard_rolls_step_1_back_to_step_0_and_retries_it_exactly(data, tmp_path):
    out = tmp_path / "strict"
    # two actor updates per step: the second one's ppo_kl is above any threshold > 0
    rc = _finish(_start(data, out, ["actor_rollout_ref.actor.ppo_mini_batch_size=2",
                                    "trainer.guard.kl_threshold=1e-12", "trainer.guard.max_retries=1",
                                    "trainer.guard.lr_factor=1", "trainer.guard.kl_coef_factor=1",
                                    "trainer.guard.clip_ratio_factor=1"]), out)
    # the KL guard's stop after its one retry (exit 3 from each rank; torchrun itself reports a failed worker with 1,
    # launch/torchrun.sh turns it back into 3)
    assert rc != 0 and "the KL guard stopped the run at step 1" in _log(out), _log(out)
    assert json.loads((out / "run_status.json").read_text())["status"] == "stopped"
    rows = read_metrics(str(out))
    assert [r["step"] for r in rows] == [1, 1] and rows[0]["guard/rolled_back"] == 1.0
    # the retry from the restored step 0 is the first try, bit for bit
    assert_same_rows(rows[:1], rows[1:], ignore=("guard/",))
