"""The same PPO run on one rank and under torchrun: TP2xPP2 on 4 gloo ranks and DP2 on 2 ranks log the metrics of
the one-rank run and end at the same weights (global token counts, whitening and KL over data-parallel ranks), with
greedy rollouts and with sampled ones (each sample drawn with its own seed: the step's, its prompt's index in the
batch and its sample index, whichever rank draws it)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from megappo.config import load_config
from megappo.testing.dist import free_port
from megappo.testing.prompts import read_metrics, tiny_run_overrides, write_prompt_parquet
from megappo.trainer import fit

pytestmark = [pytest.mark.multirank, pytest.mark.e2e]
RECIPE = "gsm8k/tiny_cpu"
KEYS = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "critic/vf_loss", "critic/grad_norm", "kl/mean",
        "reward/mean", "response/length_mean", "rollout/logprob_diff_mean")
# greedy rollouts: the sampled tokens do not depend on which data-parallel rank generates them
COMMON = ["actor_rollout_ref.rollout.temperature=0", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
          "critic.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
          "critic.ppo_micro_batch_size_per_gpu=null"]


@pytest.fixture(scope="module")
def data(tmp_path_factory, hf_model_dir):
    d = tmp_path_factory.mktemp("layout_data")
    return {"model": hf_model_dir("qwen2"), "train": write_prompt_parquet(str(d / "train.parquet"), 16)}


@pytest.fixture(scope="module")
def single(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    assert fit(load_config(RECIPE, tiny_run_overrides(str(out), data["model"], data["train"], steps=2,
                                                      extra=COMMON))) == 0
    return out


def _torchrun(nproc: int, overrides: list[str], timeout: float = 300, recipe: str = RECIPE) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}",
           "-m", "megappo.cli", "train", "--config", recipe, *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun timed out after {timeout} s:\n{out[-4000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # nothing of the run outlives the test
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, out[-6000:]


def _same_run(single_dir, other_dir, tol=1e-4):
    from safetensors.torch import load_file

    a, b = read_metrics(str(single_dir)), read_metrics(str(other_dir))
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    for ra, rb in zip(a, b):
        for k in KEYS:
            assert rb[k] == pytest.approx(ra[k], rel=tol, abs=1e-6), f"step {ra['step']} {k}"
    wa = load_file(os.path.join(single_dir, "hf", "actor", "model-00001-of-00001.safetensors"))
    wb = load_file(os.path.join(other_dir, "hf", "actor", "model-00001-of-00001.safetensors"))
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < tol


def test_tp2_pp2_on_four_ranks_matches_one_rank(data, single, tmp_path):
    # the reference and the critic follow the actor's layout
    extra = ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
             "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"]
    _torchrun(4, tiny_run_overrides(str(tmp_path), data["model"], data["train"], steps=2,
                                    extra=[*COMMON, "trainer.n_gpus_per_node=4", *extra]))
    _same_run(single, tmp_path)


def test_dp2_matches_dp1(data, single, tmp_path):
    _torchrun(2, tiny_run_overrides(str(tmp_path), data["model"], data["train"], steps=2,
                                    extra=[*COMMON, "trainer.n_gpus_per_node=2"]))
    _same_run(single, tmp_path)


def test_dp2_with_responses_of_different_lengths_on_each_rank(tmp_path):
    """Each rank's [B, R] tensors have their own R: the step's statistics must be reduced, not gathered."""
    _torchrun(2, [f"trainer.default_local_dir={tmp_path}", "trainer.n_gpus_per_node=2",
                  "trainer.total_training_steps=2", "trainer.val_before_train=false", "trainer.test_freq=-1",
                  "trainer.save_freq=-1", "data.synthetic.warm_start_steps=0", "data.synthetic.num_train_prompts=16",
                  "data.synthetic.num_val_prompts=4", "data.train_batch_size=2",
                  "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                  "data.seed=7"],  # a draw whose step 1 samples end at different lengths
              recipe="recipes/cpu/tiny_ppo.yaml")
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [1, 2]
    # one sample per rank, and they differ in length (so the ranks' R differ)
    assert rows[0]["response/length_max"] != rows[0]["response/length_mean"]
    assert all(r["critic/vf_explained_var"] is not None for r in rows)


# the main CPU job (recipes/cpu/tiny_ppo.yaml): sampled rollouts and validation (temperature 1), n = 2 samples a prompt
SAMPLED_RECIPE = "cpu/tiny_ppo"
EXACT = ("reward/mean", "reward/max", "reward/min", "response/length_mean", "response/length_max",
         "response/clip_ratio")  # token-level: the same samples give the same numbers, bit for bit
SAMPLED_KEYS = ("reward/std", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "critic/vf_loss",
                "critic/grad_norm", "kl/mean", "rollout/logprob_diff_mean", "advantages/mean", "returns/mean")


def _sampled_overrides(out) -> list[str]:
    return [f"trainer.default_local_dir={out}", "trainer.total_training_steps=3", "trainer.val_before_train=true",
            "trainer.test_freq=3", "trainer.save_freq=-1", "trainer.logger=[]", "data.synthetic.num_train_prompts=64",
            "data.synthetic.num_val_prompts=16", "data.train_batch_size=16", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8"]


@pytest.fixture(scope="module")
def single_sampled(tmp_path_factory):
    out = tmp_path_factory.mktemp("single_sampled")
    assert fit(load_config(SAMPLED_RECIPE, _sampled_overrides(out))) == 0
    return out


@pytest.mark.parametrize("nproc,layout", [
    # and validation in two batches: a later batch's prompts continue the seed count, as in one batch
    (2, ["data.val_batch_size=8"]),
    # two replicas of a TP2 actor: each replica's first rank generates its half and sends it to its TP peer
    (4, ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"]),
], ids=["dp2", "dp2_tp2"])
def test_dp2_with_sampling_matches_one_rank(single_sampled, tmp_path, nproc, layout):
    """Sampled rollouts (and sampled validation) on two data-parallel ranks draw the one-rank run's samples: the
    same rewards and lengths exactly, the same losses within float tolerance (reductions sum in another order)."""
    _torchrun(nproc, [*_sampled_overrides(tmp_path), f"trainer.n_gpus_per_node={nproc}", *layout],
              recipe=SAMPLED_RECIPE)
    a, b = read_metrics(str(single_sampled)), read_metrics(str(tmp_path))
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2, 3]
    val = sorted(k for k in a[0] if k.startswith("val/"))
    assert val and sorted(k for k in a[-1] if k.startswith("val/")) == val
    for ra, rb in zip(a, b):
        step = ra["step"]
        for k in (val if step in (0, 3) else ()):
            assert rb[k] == ra[k], f"step {step} {k}"  # validation samples at temperature 1 too
        if step == 0:
            continue
        for k in EXACT:
            assert rb[k] == ra[k], f"step {step} {k}"
        for k in SAMPLED_KEYS:
            assert rb[k] == pytest.approx(ra[k], rel=1e-4, abs=1e-6), f"step {step} {k}"
    # it did sample: not every response alike (greedy answers would all be right, reward/mean 1)
    assert any(0 < r["reward/mean"] < 1 for r in a[1:])


def test_dp2_matches_dp1_with_a_sequence_level_loss(tmp_path):
    """recipes/cpu/tiny_gspo.yaml (GSPO's sequence-level ratio, seq-mean-token-mean, sampled responses of different
    lengths): each sequence weighs the same whichever rank and micro-batch holds it, so two data-parallel ranks with
    one sequence per micro-batch log the one-rank run's losses (which runs whole mini-batches)."""
    # balanced by workload within each of the step's two mini-batches: DP2 trains the one-rank run's mini-batches
    _gspo_matches_one_rank(tmp_path, [], ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"])


def _gspo_matches_one_rank(tmp_path, common_extra: list[str], layout: list[str]) -> None:
    """tiny_gspo on one rank and on two with `layout`: the same rewards and lengths, and the same losses, grad norm,
    entropy and KL (1e-4 relative) on responses of different lengths."""
    common = ["trainer.total_training_steps=2", "trainer.val_before_train=false", "trainer.test_freq=-1",
              "trainer.save_freq=-1", "trainer.logger=[]", "data.synthetic.num_train_prompts=64", *common_extra]
    one, two = tmp_path / "one", tmp_path / "two"
    assert fit(load_config("cpu/tiny_gspo", [*common, f"trainer.default_local_dir={one}"])) == 0
    _torchrun(2, [*common, f"trainer.default_local_dir={two}", "trainer.n_gpus_per_node=2", *layout],
              recipe="recipes/cpu/tiny_gspo.yaml")
    a, b = read_metrics(str(one)), read_metrics(str(two))
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    assert any(r["response/length_max"] != r["response/length_mean"] for r in a)  # lengths differ
    for ra, rb in zip(a, b):
        for k in ("reward/mean", "response/length_mean"):
            assert rb[k] == ra[k], k
        for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss", "actor/ppo_kl"):
            assert rb[k] == pytest.approx(ra[k], rel=1e-4, abs=1e-6), f"step {ra['step']} {k}"


@pytest.mark.long
def test_cp2_matches_one_rank(data, single, tmp_path):
    """Context parallelism on two ranks (actor, reference and critic split each sequence in megatron's CP layout)
    logs the one-rank run's metrics and ends at the same weights."""
    _torchrun(2, tiny_run_overrides(str(tmp_path), data["model"], data["train"], steps=2,
                                    extra=[*COMMON, "trainer.n_gpus_per_node=2",
                                           "actor_rollout_ref.actor.megatron.context_parallel_size=2"]))
    _same_run(single, tmp_path)


@pytest.mark.long
def test_cp2_matches_one_rank_with_a_sequence_level_loss(tmp_path):
    """GSPO's sequence-level ratio at CP2: every CP rank computes the loss on whole rows (the per-token results are
    gathered over the CP group), so each sequence's ratio is the one-rank run's."""
    _gspo_matches_one_rank(tmp_path, [], ["actor_rollout_ref.actor.megatron.context_parallel_size=2"])


# tir's alignment by model-token index is checked at DP2 by tests/unit/test_token_baseline_phase.py (the gather
# is the same): its trainer run is in the long tier
@pytest.mark.parametrize("name", ["optimal_token_baseline",
                                  pytest.param("tir_optimal_token_baseline", marks=pytest.mark.long)])
def test_dp2_optimal_token_baseline_matches_one_rank(tmp_path, name):
    """The optimal token baselines on recipes/cpu/tiny_grpo.yaml (groups of 4 sampled responses of different
    lengths, balanced over the ranks by workload, so a group's responses land on both): the advantage phase gathers
    every rank's [B, R] inputs, so two data-parallel ranks log the one-rank run's advantages."""
    common = ["trainer.total_training_steps=1", "trainer.val_before_train=false", "trainer.test_freq=-1",
              "trainer.save_freq=-1", "trainer.logger=[]", "data.synthetic.num_train_prompts=64",
              f"algorithm.adv_estimator={name}",
              # a warm start short enough that responses still differ in length, long enough for some rewards
              "data.synthetic.warm_start_steps=60", "data.seed=60"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert fit(load_config("cpu/tiny_grpo", [*common, f"trainer.default_local_dir={one}"])) == 0
    _torchrun(2, [*common, f"trainer.default_local_dir={two}", "trainer.n_gpus_per_node=2"],
              recipe="recipes/cpu/tiny_grpo.yaml")
    (ra,), (rb,) = read_metrics(str(one)), read_metrics(str(two))
    assert ra["response/length_max"] != ra["response/length_mean"] and ra["advantages/mean"] != 0
    for k in ("reward/mean", "response/length_mean"):
        assert rb[k] == ra[k], k
    for k in ("advantages/mean", "returns/mean", "rollout/logprob_diff_mean"):
        assert rb[k] == pytest.approx(ra[k], rel=1e-4, abs=1e-6), k
