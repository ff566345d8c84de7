"""Micro-batching by count and by token budget: coverage, cropping, balance, order restore, equal DP counts."""
from __future__ import annotations

import pytest
import torch

from megappo.models.batch import ModelBatch, TrainInputs
from megappo.models.microbatch import plan_groups, split_batch
from megappo.testing.dist import run_distributed

PAD = 0


def _batch(prompt_lens, response_lens, seed=0) -> ModelBatch:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 100, (p,), generator=g).tolist() for p in prompt_lens]
    responses = [torch.randint(1, 100, (r,), generator=g).tolist() for r in response_lens]
    b = ModelBatch.from_token_lists(prompts, responses, PAD)
    adv = torch.randn(b.response_mask.shape, generator=g) * b.response_mask
    b.train = TrainInputs(advantages=adv)
    return b


def _check_plan(batch, plan, cropped=True):
    perm = plan.permutation
    assert sorted(perm.tolist()) == list(range(batch.batch_size))  # every row exactly once
    for mb, idx in zip(plan.micro_batches, plan.indices):
        full = batch.select(idx)
        # only padding was cropped: the real tokens and their positions are unchanged
        assert int(mb.attention_mask.sum()) == int(full.attention_mask.sum())
        assert int(mb.response_mask.sum()) == int(full.response_mask.sum())
        if cropped:
            assert mb.attention_mask.bool().any(0).all(), "a micro-batch kept an all-padding column"
    restored = plan.restore([mb.train.advantages for mb in plan.micro_batches])
    torch.testing.assert_close(restored, batch.train.advantages)


def test_fixed_micro_batches_crop_their_own_padding():
    batch = _batch([3, 7, 2, 5, 4], [6, 1, 9, 2, 3])
    plan = split_batch(batch, micro_batch_size=2)
    assert [len(i) for i in plan.indices] == [2, 2, 1]
    assert plan.indices[0].tolist() == [0, 1]
    assert plan.micro_batches[0].prompt_len == 7 and plan.micro_batches[0].response_len == 6
    assert plan.micro_batches[2].seq_len == 4 + 3
    _check_plan(batch, plan)
    one = split_batch(batch)  # None: the whole batch in one micro-batch
    assert len(one) == 1
    _check_plan(batch, one)


def test_dynamic_micro_batches_fit_the_budget_and_balance():
    g = torch.Generator().manual_seed(1)
    plens = torch.randint(1, 20, (32,), generator=g).tolist()
    rlens = torch.randint(1, 40, (32,), generator=g).tolist()
    batch = _batch(plens, rlens)
    budget = 160
    plan = split_batch(batch, max_token_len=budget, use_dynamic_bsz=True)
    costs = [mb.batch_size * mb.seq_len for mb in plan.micro_batches]
    assert max(costs) <= budget
    _check_plan(batch, plan)
    # balanced: asking for more micro-batches than the minimum evens the costs rather than leaving a tiny tail
    groups = plan_groups(plens, rlens, budget, len(plan) + 2)
    assert len(groups) == len(plan) + 2
    costs = [len(gr) * (max(plens[i] for i in gr) + max(rlens[i] for i in gr)) for gr in groups]
    assert max(costs) <= budget and min(costs) >= max(costs) / 4


def test_errors_name_the_fix():
    batch = _batch([5, 5], [30, 2])
    with pytest.raises(ValueError, match="ppo_max_token_len_per_gpu"):
        split_batch(batch, max_token_len=20, use_dynamic_bsz=True)
    with pytest.raises(ValueError, match="ppo_micro_batch_size_per_gpu"):
        split_batch(batch, micro_batch_size=0)
    with pytest.raises(ValueError, match="response_mask"):
        ModelBatch(batch.input_ids, batch.attention_mask, batch.position_ids, batch.response_mask[:1])


def _dp_worker(rank, world_size):
    import torch.distributed as dist

    # rank 0 has short sequences (1 micro-batch would do), rank 1 long ones (several)
    lens = [4] * 6 if rank == 0 else [30] * 6
    batch = _batch(lens, lens, seed=rank)
    plan = split_batch(batch, max_token_len=128, use_dynamic_bsz=True, dp_group=dist.group.WORLD)
    _check_plan(batch, plan)
    fixed = split_batch(batch.slice(0, 2 + 2 * rank), micro_batch_size=2, dp_group=dist.group.WORLD)
    return len(plan), len(fixed)


@pytest.mark.multirank  # two gloo ranks in subprocesses
def test_micro_batch_count_is_equal_across_dp_ranks():
    counts = run_distributed(_dp_worker, 2, timeout=120)
    assert counts[0] == counts[1]
    assert counts[0][0] == 3 and counts[0][1] == 2


def test_uniform_shape_and_count_multiple_pad_without_changing_results():
    batch = _batch([3, 7, 2, 5, 4], [6, 1, 9, 2, 3])
    plan = split_batch(batch, micro_batch_size=2, count_multiple=2, uniform_shape=True)
    assert len(plan) == 4  # 3 micro-batches rounded up to a multiple of 2
    shapes = {(mb.batch_size, mb.prompt_len, mb.response_len) for mb in plan.micro_batches}
    assert len(shapes) == 1
    for mb, idx in zip(plan.micro_batches, plan.indices):
        extra = mb.select(slice(len(idx), None))  # appended all-padding rows
        assert not extra.attention_mask.any() and not extra.response_mask.any()
        assert not extra.train.advantages.any()
    _check_plan(batch, plan, cropped=False)


def test_pad_to_keeps_tokens_and_positions():
    batch = _batch([2, 4], [3, 1])
    padded = batch.pad_to(3, batch.prompt_len + 2, batch.response_len + 1)
    assert padded.input_ids.shape == (3, 4 + 2 + 3 + 1)
    torch.testing.assert_close(padded.crop(batch.prompt_len, batch.response_len).select([0, 1]).input_ids,
                               batch.input_ids)
    assert padded.prompt_lengths().tolist() == [2, 4, 0]
    with pytest.raises(ValueError, match="smaller than the batch"):
        batch.pad_to(1, batch.prompt_len, batch.response_len)


def test_a_batch_whose_every_response_is_empty_keeps_one_masked_column():
    """A step whose agents all failed before calling has only empty responses: the batch still has a response
    column (padding, masked), so every phase's [B, R] indexing and reductions work (was: IndexError in amax)."""
    from megappo.models.batch import ModelBatch

    b = ModelBatch.from_token_lists([[5, 6], [7]], [[], []], pad_token_id=0)
    assert b.response_len == 1 and b.response_mask.tolist() == [[0], [0]]
    assert b.response_lengths().tolist() == [0, 0] and b.prompt_lengths().tolist() == [2, 1]
    assert b.input_ids[:, -1].tolist() == [0, 0]
