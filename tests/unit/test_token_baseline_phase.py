"""The trainer's advantage phase runs the optimal token baselines on the whole step's groups.

Each data-parallel rank holds its share of the samples, padded to its own longest response; the phase gathers the
[B, R] inputs (rewards, mask, old log-probs, sum_v pi^2, rollout IS weights) of every rank, so a prompt's group
split over two ranks gets the advantages of the whole batch in one process (`estimators.compute_advantages`).
"""
from __future__ import annotations

import pytest
import torch

from megappo.testing.dist import run_distributed

# 3 prompts x 4 samples; the rank split puts parts of every group on both ranks, and rank 1's longest response is
# shorter than rank 0's (different R); the 9th sample is empty (tir leaves it out of its group)
UIDS = [0, 0, 1, 2, 1, 0, 2, 1, 2, 0, 1, 2]
LENGTHS = [5, 2, 7, 3, 4, 6, 1, 3, 0, 2, 4, 5]
RANK_ROWS = [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 11]]


def _samples():
    from megappo.trainer.experience import Samples

    n = len(UIDS)
    g = torch.Generator().manual_seed(5)
    responses = [torch.randint(3, 50, (k,), generator=g).tolist() for k in LENGTHS]
    loss_masks = [None] * n
    loss_masks[2] = [1, 1, 0, 0, 1, 1, 1]  # a tool answer in the middle: tir aligns by the model's tokens
    return Samples(prompt_ids=[[1, 2]] * n, response_ids=responses,
                   rollout_log_probs=[(-torch.rand(k, generator=g)).tolist() for k in LENGTHS],
                   truncated=[False] * n, uids=UIDS, data_sources=["t"] * n, ground_truths=[None] * n,
                   extra_infos=[{}] * n, weight_versions=[0] * n, dataset_indices=UIDS, partial=[False] * n,
                   loss_masks=loss_masks)


def _fill(exp, with_is: bool):
    """Deterministic per-sample inputs (a sample's values do not depend on which rank holds it)."""
    r = exp.mask.shape[1]
    for row, i in enumerate(exp.indices):
        g = torch.Generator().manual_seed(100 + i)
        full = [torch.randn(8, generator=g), -torch.rand(8, generator=g) * 3, torch.rand(8, generator=g) * 0.5,
                0.5 + torch.rand(8, generator=g)]  # 8 > the longest response: the same numbers at any R
        exp.token_rewards[row], exp.train.old_log_probs[row], exp.sum_pi_squared[row] = (x[:r] for x in full[:3])
        if with_is:
            exp.train.rollout_is_weights[row] = full[3][:r]
    m = exp.mask.float()
    exp.token_rewards *= m
    exp.train.old_log_probs *= m


def _advantages(name: str, rows, dp, with_is: bool):
    from types import SimpleNamespace

    from megappo.config import load_config
    from megappo.trainer import phases
    from megappo.trainer.experience import build_experience

    exp = build_experience(_samples(), rows, pad_token_id=0)
    shape = exp.mask.shape
    exp.token_rewards, exp.sum_pi_squared = torch.zeros(shape), torch.zeros(shape)
    exp.train.old_log_probs = torch.zeros(shape)
    exp.train.rollout_is_weights = torch.zeros(shape) if with_is else None
    _fill(exp, with_is)
    cfg = load_config(None, ["actor_rollout_ref.model.path=/m", f"algorithm.adv_estimator={name}",
                             "actor_rollout_ref.rollout.n=4"])
    run = SimpleNamespace(cfg=cfg, ps=SimpleNamespace(dp_size=dp[0], dp_rank=dp[1], dp_group=None))
    phases.advantages(run, exp)
    return exp


def _dp2_worker(rank, world_size, name, with_is):
    exp = _advantages(name, RANK_ROWS[rank], (world_size, rank), with_is)
    return [exp.indices, exp.train.advantages.tolist(), exp.train.returns.tolist()]


@pytest.mark.multirank  # two gloo ranks in subprocesses
@pytest.mark.parametrize("name,with_is", [("optimal_token_baseline", False), ("tir_optimal_token_baseline", True)])
def test_dp2_advantages_equal_the_whole_batchs(name, with_is):
    from megappo.algos import estimators

    whole = _advantages(name, range(len(UIDS)), (1, 0), with_is)
    t = whole.train
    adv, ret = estimators.compute_advantages(
        estimators.get_adv_estimator(name), whole.token_rewards, whole.mask,
        estimators.EstimatorParams(gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True, gdpo_reward_weights=None),
        group_ids=whole.uids, old_log_probs=t.old_log_probs, sum_pi_squared=whole.sum_pi_squared,
        is_weights=t.rollout_is_weights)
    torch.testing.assert_close(t.advantages, adv)
    torch.testing.assert_close(t.returns, ret)
    assert t.advantages.abs().sum() > 0
    for indices, a, r in run_distributed(_dp2_worker, 2, name, with_is, timeout=120):
        a, r = torch.tensor(a), torch.tensor(r)
        width = a.shape[1]
        assert width < adv.shape[1] or indices == RANK_ROWS[0]
        torch.testing.assert_close(a, adv[indices, :width], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(r, ret[indices, :width], rtol=1e-6, atol=1e-6)
        assert not adv[indices, width:].any()  # nothing cut off past a rank's own longest response


def test_rollout_is_weights_change_the_baseline():
    a = _advantages("optimal_token_baseline", range(len(UIDS)), (1, 0), True).train.advantages
    b = _advantages("optimal_token_baseline", range(len(UIDS)), (1, 0), False).train.advantages
    assert not torch.allclose(a, b)
