"""The trainer's pure parts: config -> settings mapping, experience assembly, workload balancing, loss closures."""
from __future__ import annotations

import pytest
import torch

from megappo import algos
from megappo.config import load_config, resolve
from megappo.models.batch import ModelBatch, TrainInputs
from megappo.models.compute import MicroBatchContext, ModelOutputs
from megappo.models.losses import ActorLossSettings, CriticLossSettings, actor_loss_fn, critic_loss_fn
from megappo.rollout.sampling import Completion
from megappo.trainer import settings
from megappo.trainer.experience import (
    Samples, balanced_partitions, build_experience, mini_batch_blocks, mini_batches,
)

torch.set_num_threads(1)


def test_config_names_map_onto_algos_names():
    cfg = resolve(load_config(None, [
        "actor_rollout_ref.actor.clip_ratio=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.clip_ratio_c=4.0", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_type=k2",
        "critic.cliprange_value=0.3", "actor_rollout_ref.actor.entropy_coeff=0.01"]))
    a = settings.actor_loss(cfg)
    assert (a.clip_low, a.clip_high, a.clip_c, a.agg_mode, a.kl_loss_type, a.entropy_coeff) == \
        (0.2, 0.28, 4.0, "seq-mean-token-sum", "k2", 0.01)
    c = settings.critic_loss(cfg)
    assert (c.clip_range, c.agg_mode) == (0.3, "seq-mean-token-sum")  # critic follows the actor's agg mode
    o = settings.optim_settings(cfg, "actor", total_steps=10)
    assert (o.lr, o.total_steps, o.clip_grad) == (cfg.actor_rollout_ref.actor.optim.lr, 10, 1.0)


def test_batching_counts_mini_batches_in_prompts():
    cfg = resolve(load_config(None, ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                                     "actor_rollout_ref.actor.ppo_epochs=3"]))
    b = settings.batching(cfg)
    assert (b.actor_mini_batches, b.actor_epochs, b.critic_mini_batches, b.critic_epochs) == (4, 3, 4, 3)


def _samples() -> Samples:
    from megappo.data.dataset import PromptBatch

    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    prompts = PromptBatch(ids, (ids > 0).long(), torch.zeros_like(ids), [[], []], ["a", "b"], ["1", "2"], [{}, {}],
                          ["", ""], torch.tensor([3, 4]))
    comps = [[Completion(0, [11, 12, 2], [-0.1, -0.2, -0.3], "stop"), Completion(0, [13], [-0.5], "length")],
             [Completion(1, [14, 15], [-1.0, -2.0], "stop"), Completion(1, [16, 17, 18, 19], [-1.0] * 4, "length")]]
    return Samples.from_completions(prompts, comps)


def test_samples_and_experience_from_completions():
    s = _samples()
    assert s.prompt_ids == [[5, 6], [5, 6], [7, 8, 9, 10], [7, 8, 9, 10]]
    assert s.uids == [0, 0, 1, 1] and s.truncated == [False, True, False, True]
    exp = build_experience(s, [1, 2], pad_token_id=0)
    assert exp.batch.input_ids.tolist() == [[0, 0, 5, 6, 13, 0], [7, 8, 9, 10, 14, 15]]
    assert exp.mask.tolist() == [[1, 0], [1, 1]]
    assert exp.rollout_log_probs.tolist() == [[-0.5, 0.0], [-1.0, -2.0]]
    assert exp.uids.tolist() == [0, 1] and exp.data_sources == ["a", "b"]


def test_balanced_partitions_are_equal_sized_and_even():
    loads = [100, 1, 1, 1, 50, 50, 2, 3]
    parts = balanced_partitions(loads, 2)
    assert sorted(i for p in parts for i in p) == list(range(8)) and all(len(p) == 4 for p in parts)
    sums = [sum(loads[i] for i in p) for p in parts]
    assert max(sums) - min(sums) <= 52  # 100 alone on one side, both 50s on the other
    assert balanced_partitions(loads, 1) == [list(range(8))]
    with pytest.raises(ValueError, match="do not split evenly"):
        balanced_partitions(loads, 3)


def _step_samples(prompts: int, n: int) -> Samples:
    """`prompts` groups of `n` sampled responses whose lengths (1-9 tokens) vary within and between groups."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 10, (prompts * n,), generator=g).tolist()
    total, uids = prompts * n, [i // n for i in range(prompts * n)]
    return Samples(prompt_ids=[[1, 2, 3]] * total, response_ids=[[5] * k for k in lengths],
                   rollout_log_probs=[[-0.5] * k for k in lengths], truncated=[False] * total, uids=uids,
                   data_sources=["t"] * total, ground_truths=[None] * total, extra_infos=[{}] * total,
                   weight_versions=[0] * total, dataset_indices=uids, partial=[False] * total)


@pytest.mark.parametrize("prefix_sharing", [None, False])
def test_each_data_parallel_rank_trains_its_share_of_one_ranks_mini_batches(prefix_sharing):
    """recipes/cpu/tiny_moe_replay.yaml's step: 16 prompts x 4 responses of different lengths, two mini-batches of
    8 prompts. Balanced by workload over two data-parallel ranks, each rank's j-th mini-batch holds its share of
    the samples one rank's j-th optimizer step trains, so DP2 (and EP2) learn what one rank does: balancing over
    the whole step moved samples into the other mini-batch, and the EP2 run's step-2 reward was 0.281 against one
    rank's 0.25. The ranks' token counts stay balanced in each mini-batch, a prompt's group on one rank."""
    from types import SimpleNamespace

    from megappo.trainer import phases
    from megappo.trainer.replay import Replay

    cfg = resolve(load_config("cpu/tiny_moe_replay", [
        "actor_rollout_ref.model.path=/m", f"actor_rollout_ref.model.use_prefix_sharing={prefix_sharing}"]))
    batching, samples = settings.batching(cfg), _step_samples(16, 4)
    assert batching.actor_mini_batches == 2 and cfg.trainer.balance_batch
    tokens = [3 + len(r) for r in samples.response_ids]
    shares: list[list[list[int]]] = []  # [rank][mini-batch] the samples it trains
    for rank in (0, 1):
        run = SimpleNamespace(cfg=cfg, ps=SimpleNamespace(dp_size=2, dp_rank=rank), batching=batching,
                              roles=SimpleNamespace(critic=None), replay=Replay("disabled", None), pad_token_id=0)
        exp = phases.make_experience(run, samples, None)
        shares.append([[exp.indices[i] for i in mb.tolist()]
                       for mb in mini_batches(len(exp.indices), batching.actor_mini_batches, shuffle=False, seed=0)])
    for j in range(2):
        assert sorted(shares[0][j] + shares[1][j]) == list(range(32 * j, 32 * (j + 1))), f"mini-batch {j}"
        load = [sum(tokens[i] for i in shares[rank][j]) for rank in (0, 1)]
        assert abs(load[0] - load[1]) <= 9 * 4, load  # within a group's largest workload difference
    if prefix_sharing is None:
        assert all(len({samples.uids[i] for i in shares[0][j]} & {samples.uids[i] for i in shares[1][j]}) == 0
                   for j in range(2))


def test_mini_batch_blocks_are_the_finest_both_roles_mini_batches_are_made_of():
    assert mini_batch_blocks(64, 2, 2, 1) == 2  # the actor's two mini-batches (no critic)
    assert mini_batch_blocks(64, 2, 2, 4) == 4  # a critic with mini-batches of half the actor's
    assert mini_batch_blocks(48, 2, 2, 3) == 6
    assert mini_batch_blocks(40, 2, 2, 3) == 1  # 3 does not divide a rank's 20 (`mini_batches` says so)
    parts = balanced_partitions([9, 1, 1, 1, 1, 1, 1, 9], 2, blocks=2)
    assert parts == [[0, 3, 6, 7], [1, 2, 4, 5]]  # a rank's first half from the first 4 samples, its second after
    # balanced over the whole step, sample 4 (of the second mini-batch) is in rank 1's first
    assert balanced_partitions([9, 1, 1, 1, 1, 1, 1, 9], 2) == [[0, 1, 3, 5], [2, 4, 6, 7]]
    with pytest.raises(ValueError, match="in each of 3 mini-batches"):
        balanced_partitions([1] * 8, 2, blocks=3)


def test_mini_batches_cover_every_sample_once():
    for shuffle in (False, True):
        parts = mini_batches(12, 3, shuffle=shuffle, seed=5)
        assert sorted(torch.cat(parts).tolist()) == list(range(12)) and all(len(p) == 4 for p in parts)
    assert [p.tolist() for p in mini_batches(4, 2, shuffle=False, seed=0)] == [[0, 1], [2, 3]]


def _ctx(batch, tokens, seqs):
    return MicroBatchContext(batch, tokens, seqs, 0, 1)


def test_actor_loss_closure_is_a_share_of_the_mini_batch_loss():
    g = torch.Generator().manual_seed(0)
    b, r = 4, 5
    mask = torch.ones(b, r)
    mask[0, 3:] = 0
    logp, old, ref, adv = (torch.randn(b, r, generator=g) for _ in range(4))
    batch = ModelBatch(torch.zeros(b, r + 2, dtype=torch.long), torch.ones(b, r + 2, dtype=torch.long),
                       torch.zeros(b, r + 2, dtype=torch.long), mask,
                       TrainInputs(old_log_probs=old, ref_log_probs=ref, advantages=adv))
    s = ActorLossSettings(clip_c=3.0, use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01)
    ent = torch.rand(b, r, generator=g)
    fn = actor_loss_fn(s)
    whole, m = fn(ModelOutputs(log_probs=logp, entropy=ent), _ctx(batch, int(mask.sum()), b))
    want_pg, _ = algos.policy_loss(logp, old, adv, mask, clip_c=3.0)
    want = want_pg + 0.1 * algos.masked_mean(algos.kl_penalty(logp, ref, "low_var_kl"), mask) \
        - 0.01 * algos.masked_mean(ent, mask)
    torch.testing.assert_close(whole, want)
    # two halves with the global counts add up to the whole, losses and metrics alike
    n = int(mask.sum())
    halves = [fn(ModelOutputs(log_probs=logp[i], entropy=ent[i]), _ctx(batch.select(i), n, b))
              for i in (slice(0, 2), slice(2, 4))]
    torch.testing.assert_close(halves[0][0] + halves[1][0], whole)
    for k in m:
        torch.testing.assert_close(halves[0][1][k] + halves[1][1][k], m[k])


def test_critic_loss_closure():
    values, old, ret = torch.tensor([[1.0, 2.0]]), torch.tensor([[1.1, 0.0]]), torch.tensor([[1.0, 3.0]])
    batch = ModelBatch(torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.long),
                       torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 2), TrainInputs(values=old, returns=ret))
    loss, m = critic_loss_fn(CriticLossSettings(clip_range=0.5))(ModelOutputs(values=values), _ctx(batch, 2, 1))
    # token 0 inside the clip range; token 1 clipped to 0.5, whose error (2.5^2) beats the unclipped (1^2)
    assert m["vf_clipfrac"].item() == pytest.approx(0.5)
    assert loss.item() == pytest.approx(0.5 * (0.0 + 6.25) / 2)


def test_the_entry_point_stays_a_function_after_its_first_call():
    """`megappo.trainer.fit` imports the loop's module on its first call; a submodule of the same name would replace
    the package's `fit` with the module, and a second run in the process (a user's sweep, a test) would fail with
    "'module' object is not callable"."""
    import megappo.trainer

    with pytest.raises(AttributeError):
        megappo.trainer.fit(None)  # gets as far as the loop's module, which reads the (missing) config
    assert callable(megappo.trainer.fit) and megappo.trainer.fit.__module__ == "megappo.trainer"
