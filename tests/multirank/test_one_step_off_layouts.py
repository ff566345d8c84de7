"""async_training.mode=one_step_off (and fully_async on its schedule) under torchrun: DP2 (each replica's engine process generates its half of the
next batch while the ranks train) and TP2 x PP2 (one replica, its first rank's engine) draw and train on the samples
of the one-rank run: the same rewards and lengths exactly, the same losses within float tolerance (reductions sum in
another order), one update behind from the second step on."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from megappo.config import load_config
from megappo.testing.dist import free_port
from megappo.testing.prompts import read_metrics
from megappo.trainer import fit

pytestmark = [pytest.mark.multirank, pytest.mark.e2e]
RECIPE = "cpu/tiny_ppo_one_step_off"
EXACT = ("reward/mean", "reward/max", "reward/min", "response/length_mean", "response/length_max",
         "async/staleness_max", "rollout/weight_version")
CLOSE = ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "kl/mean", "rollout/logprob_diff_mean",
         "advantages/mean")


def _overrides(out) -> list[str]:
    return [f"trainer.default_local_dir={out}", "trainer.total_training_steps=3", "trainer.val_before_train=false",
            "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.logger=[]", "data.synthetic.num_train_prompts=64",
            "data.train_batch_size=16", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("one_step_off_single")
    assert fit(load_config(RECIPE, _overrides(out))) == 0
    return out


def _torchrun(nproc: int, overrides: list[str], timeout: float = 400) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}",
           "-m", "megappo.cli", "train", "--config", RECIPE, *overrides]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun timed out after {timeout} s:\n{out[-4000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # nothing of the run (engine processes included) outlives the test
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, out[-6000:]


FULLY_AS_ONE_STEP_OFF = ["async_training.mode=fully_async", "async_training.trigger_parameter_sync_step=1",
                         "async_training.staleness_threshold=1", "async_training.require_batches=2"]


# one_step_off is fully_async's schedule with W = 1 and threshold 1: the default tier runs that spelling at DP2; the
# others (and TP2 x PP2, which tests/multirank/test_trainer_layouts.py covers in sync mode) are long
@pytest.mark.parametrize("nproc,layout", [
    pytest.param(2, [], marks=pytest.mark.long),
    pytest.param(4, ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                     "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"], marks=pytest.mark.long),
    # fully_async's producers (one per replica) on the one_step_off schedule: the same run
    (2, FULLY_AS_ONE_STEP_OFF),
    pytest.param(4, [*FULLY_AS_ONE_STEP_OFF, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                     "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"], marks=pytest.mark.long),
], ids=["dp2", "tp2pp2", "fully_async_dp2", "fully_async_tp2pp2"])
def test_one_step_off_layouts_train_the_one_rank_run(single, tmp_path, nproc, layout):
    _torchrun(nproc, [*_overrides(tmp_path), f"trainer.n_gpus_per_node={nproc}", *layout])
    a, b = read_metrics(str(single)), read_metrics(str(tmp_path))
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    assert [r["async/staleness_max"] for r in b] == [0.0, 1.0, 1.0]
    for ra, rb in zip(a, b):
        for k in EXACT:
            assert rb[k] == ra[k], f"step {ra['step']} {k}"
        for k in CLOSE:
            assert rb[k] == pytest.approx(ra[k], rel=1e-3, abs=1e-5), f"step {ra['step']} {k}"
