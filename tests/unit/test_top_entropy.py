"""actor.policy_loss.top_entropy_quantile: the chosen tokens equal a direct computation (one rank and two), the loss
trains on them only with the normaliser of all tokens, and the settings it cannot go with are refused."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megappo.algos.policy_losses import PolicyLossParams, get_policy_loss
from megappo.algos.token_selection import entropy_threshold, high_entropy_tokens
from megappo.checks import validate
from megappo.config import ConfigError, load_config
from megappo.models.batch import TrainInputs
from megappo.models.losses import _token_weights
from megappo.testing.dist import run_distributed

torch.set_num_threads(1)


def _direct(entropy: torch.Tensor, mask: torch.Tensor, q: float) -> torch.Tensor:
    """The top ceil(q * N) tokens by entropy, ties at the k-th value all in: by sorting every valid token."""
    values = sorted(entropy[mask.bool()].tolist(), reverse=True)
    kth = values[max(1, math.ceil(q * len(values))) - 1]
    return ((entropy >= kth) & mask.bool()).float()


def _batch(seed: int, b: int = 6, r: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    entropy = torch.rand(b, r, generator=g) * 3
    entropy[0, :3] = 1.5  # ties
    lengths = torch.randint(0, r + 1, (b,), generator=g)
    lengths[1] = 0  # an empty response
    mask = (torch.arange(r) < lengths.unsqueeze(1)).float()
    return entropy, mask


@pytest.mark.parametrize("q", [0.2, 0.5, 0.999, 1.0])
def test_chosen_tokens_equal_a_direct_computation(q):
    entropy, mask = _batch(0)
    chosen = high_entropy_tokens(entropy, mask, entropy_threshold(entropy[mask.bool()], q))
    assert torch.equal(chosen, _direct(entropy, mask, q))
    n = int(mask.sum())
    assert chosen.sum() >= math.ceil(q * n) and not (chosen * (1 - mask)).any()  # never a padding token
    if q == 1.0:
        assert torch.equal(chosen, mask)


def test_threshold_edges():
    assert entropy_threshold(torch.empty(0), 0.2) == float("-inf")  # no tokens: nothing to leave out
    assert entropy_threshold(torch.tensor([0.3]), 0.01) == pytest.approx(0.3)  # at least one token trains
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="top_entropy_quantile"):
            entropy_threshold(torch.tensor([1.0]), bad)


def test_the_loss_trains_the_chosen_tokens_with_every_tokens_normaliser():
    entropy, mask = _batch(1)
    g = torch.Generator().manual_seed(2)
    lp = (-torch.rand(mask.shape, generator=g)).requires_grad_()
    old, adv = lp.detach() + 0.05 * torch.randn(mask.shape, generator=g), torch.randn(mask.shape, generator=g)
    chosen = _direct(entropy, mask, 0.3)
    t = TrainInputs(rollout_is_weights=torch.full(mask.shape, 0.5), pg_token_mask=chosen)
    loss, _ = get_policy_loss("vanilla")(lp, old, adv, mask, PolicyLossParams(), agg_mode="token-mean",
                                         num_tokens=int(mask.sum()), is_weights=_token_weights(t))
    loss.backward()
    ratio = torch.exp(lp.detach() - old)
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * 3.0), per_token)  # dual clip
    assert loss.item() == pytest.approx(float((per_token * 0.5 * chosen).sum() / mask.sum()), rel=1e-6)
    assert not lp.grad[chosen == 0].any() and lp.grad[chosen == 1].abs().sum() > 0
    assert _token_weights(TrainInputs()) is None  # off: the loss is untouched
    assert torch.equal(_token_weights(TrainInputs(pg_token_mask=chosen)), chosen)


def _choose_on_rank(rank: int, world: int, q: float):
    from megappo.trainer.entropy_tokens import choose_tokens

    entropy, mask = _batch(10 + rank, r=7 + 3 * rank)  # the ranks' responses differ in length
    exp = SimpleNamespace(mask=mask, train=TrainInputs())
    ps = SimpleNamespace(dp_group=dist.group.WORLD, dp_size=world, dp_rank=rank)
    metrics = choose_tokens(exp, entropy, q, ps)
    return exp.train.pg_token_mask, metrics


@pytest.mark.multirank
def test_two_data_parallel_ranks_choose_what_one_rank_with_the_whole_batch_chooses():
    q = 0.25
    (c0, m0), (c1, m1) = run_distributed(_choose_on_rank, 2, q, timeout=120)
    (e0, k0), (e1, k1) = _batch(10, r=7), _batch(11, r=10)
    width = 10
    whole_e = torch.cat([torch.nn.functional.pad(e0, (0, 3)), e1])
    whole_m = torch.cat([torch.nn.functional.pad(k0, (0, 3)), k1])
    whole = _direct(whole_e, whole_m, q)
    assert torch.equal(c0, whole[:6, :7]) and torch.equal(c1, whole[6:, :width])
    assert m0 == m1  # one number per step on every rank
    assert m0["actor/selected_token_fraction"] == pytest.approx(float(whole.sum() / whole_m.sum()))
    assert 0.25 <= m0["actor/selected_token_fraction"] < 0.35


@pytest.mark.parametrize("overrides, needle", [
    (["actor_rollout_ref.actor.policy_loss.top_entropy_quantile=0"], "must be in (0, 1]"),
    (["actor_rollout_ref.actor.policy_loss.top_entropy_quantile=0.2",
      "actor_rollout_ref.actor.policy_loss.loss_mode=geo_mean"], "geo_mean makes one term of each response"),
    (["actor_rollout_ref.actor.policy_loss.top_entropy_quantile=0.2",
      "algorithm.rollout_correction.bypass_mode=true"], "bypass_mode skips"),
])
def test_settings_it_cannot_go_with_are_refused(overrides, needle):
    cfg = load_config(None, ["actor_rollout_ref.model.path=/models/m", *overrides])
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=1)
    assert needle in str(e.value) and "actor_rollout_ref.actor.policy_loss.top_entropy_quantile" in str(e.value)
