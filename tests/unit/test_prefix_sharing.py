"""Prefix sharing (`megappo.models.layout.prefix`): the shared pack's layout and read-back, its attention against
each row alone, micro-batches and data-parallel shares that keep a prompt's rows together, the automatic choice
and the config key. The model-level exactness (log-probs, entropy, values, losses, gradients against the packed
and padded paths, TP / SP / PP / VPP / DP / EP / CP) is tests/multirank/test_prefix_sharing_layouts.py."""
from __future__ import annotations

import pytest
import torch

from megappo.models.batch import ModelBatch
from megappo.models.compute import _response_window
from megappo.models.layout.context_parallel import positions
from megappo.models.layout.packing import pack_micro_batch
from megappo.models.layout.prefix_cp import PlainRows, TreeRowParams, tree_rows
from megappo.models.layout.prefix import (
    MIN_PROMPT, can_share, prompt_groups, share_micro_batch, sharing_on, sharing_pays,
)
from megappo.models.microbatch import real_tokens, split_batch
from megappo.testing.dist import run_distributed

torch.set_num_threads(1)


def _batch():
    # rows 0, 2, 3 share prompt [5, 6, 7]; row 1 alone; row 3's response is empty
    prompts = [[5, 6, 7], [8, 9], [5, 6, 7], [5, 6, 7]]
    responses = [[11, 12], [13, 14, 15], [16, 17, 18, 19], []]
    return ModelBatch.from_token_lists(prompts, responses, pad_token_id=0)


def test_shared_pack_runs_each_prompt_once_with_each_rows_positions():
    b = _batch()
    assert prompt_groups(b) == [[0, 2, 3], [1]]
    p = share_micro_batch(b)
    # tree 0: the prompt once, then rows 0, 2 (and 3's nothing); tree 1: row 1 whole
    assert p.input_ids.tolist() == [[5, 6, 7, 11, 12, 16, 17, 18, 19, 8, 9, 13, 14, 15]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 4, 5, 6, 0, 1, 2, 3, 4]]
    assert p.cu_seqlens.tolist() == [0, 9, 14] and p.cu_seqlens.dtype == torch.int32
    assert p.trees[0].prompt_len == 3 and p.trees[0].responses == ((3, 2), (5, 4))
    assert p.trees[1].prompt_len == 5 and p.trees[1].responses == ()
    assert p.max_seqlen == 7  # row 2: 3 + 4 tokens
    params = p.packed_seq_params()
    assert params.qkv_format == "thd" and params.rotary_positions.tolist() == p.position_ids[0].tolist()


def test_shared_pack_reads_each_rows_outputs_where_the_unshared_pack_does():
    """Any per-token function of (token, position) read back per row equals the unshared pack's reading."""
    b = _batch()
    shared, plain = share_micro_batch(b), pack_micro_batch(b)
    window = (b.prompt_lengths() - 1).unsqueeze(1) + torch.arange(b.response_len).unsqueeze(0)  # as compute reads

    def f(pack):  # [1, T, 2]: a value that depends on a token's id and position only
        return torch.stack([pack.input_ids * 100 + pack.position_ids, pack.position_ids], -1).float()

    assert torch.equal(shared.window(f(shared), window), plain.window(f(plain), window))


def test_tail_padding_and_padding_rows():
    b = _batch().pad_to(6, 3, 4)  # two all-padding rows: no tokens
    p = share_micro_batch(b, pack_len=15, multiple=4)
    assert p.num_tokens == 16 and p.cu_seqlens.tolist() == [0, 9, 14, 16]
    assert p.input_ids[0, 14:].tolist() == [0, 0] and p.trees[-1].responses == ()
    assert p.lengths.tolist() == [5, 5, 7, 3, 0, 0]


def _token_sources(b: ModelBatch, pack) -> list[tuple[int, int]]:
    """(row, left-aligned column) of each token of `pack` (a shared prompt token: the last row that reads it)."""
    idx = pack.window(torch.arange(pack.num_tokens).view(1, -1, 1).float(),
                      torch.arange(b.seq_len).expand(b.batch_size, -1))[..., 0].long()
    src = [(0, 0)] * pack.num_tokens
    for row in range(b.batch_size):
        for col in range(int(pack.lengths[row])):
            src[int(idx[row, col])] = (row, col)
    return src


def _attention_job(rank, world_size):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megappo.models.attention import SDPAttention
    from megappo.parallel import destroy_parallel, init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout

    init_parallel(ParallelLayout(), detect_platform(), seed=0)
    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                            use_cpu_initialization=True, attention_dropout=0.0)
    attn = SDPAttention(cfg, 1, AttnMaskType.causal, "self")
    prompt_of = [0, 0, 1, 0, 2, 1]
    prompts = [[1] * 9, [2] * 4, [3] * 6]
    b = ModelBatch.from_token_lists([prompts[k] for k in prompt_of], [[4] * n for n in (5, 12, 1, 7, 3, 2)],
                                    pad_token_id=0)
    plen = b.prompt_lengths().tolist()
    g = torch.Generator().manual_seed(0)
    heads = {"q": 4, "k": 2, "v": 2}
    # leaves: each prompt's q/k/v (shared by its rows) and each row's response q/k/v
    prompt_leaf = {n: [torch.randn(len(p), h, 16, generator=g).requires_grad_() for p in prompts]
                   for n, h in heads.items()}
    resp_leaf = {n: [torch.randn(b.seq_len, h, 16, generator=g).requires_grad_() for _ in prompt_of]
                 for n, h in heads.items()}

    def run(pack):
        src = _token_sources(b, pack)
        qkv = [torch.stack([prompt_leaf[n][prompt_of[r]][c] if c < plen[r] else resp_leaf[n][r][c - plen[r]]
                            for r, c in src]) for n in "qkv"]
        out = attn(*qkv, None, packed_seq_params=pack.packed_seq_params())  # [t, np * hn]
        read = pack.window(out.unsqueeze(0), torch.arange(b.seq_len).expand(b.batch_size, -1))  # [b, s, np * hn]
        real = torch.arange(b.seq_len).unsqueeze(0) < pack.lengths.unsqueeze(1)
        read = read * real.unsqueeze(-1)
        leaves = [x for n in "qkv" for x in prompt_leaf[n] + resp_leaf[n]]
        grads = torch.autograd.grad((read * torch.linspace(-1, 1, read.numel()).view_as(read)).sum(), leaves)
        return read, torch.cat([x.reshape(-1) for x in grads])

    got, got_grad = run(share_micro_batch(b))
    want, want_grad = run(pack_micro_batch(b))
    destroy_parallel()
    return {"out": (got - want).abs().max().item(), "scale": want.abs().max().item(),
            "grad": (got_grad - want_grad).abs().max().item(), "grad_scale": want_grad.abs().max().item()}


def test_attention_over_the_shared_pack_equals_each_row_alone():
    """SDPAttention (GQA) on a shared pack: every row's outputs and the q/k/v gradients equal the unshared pack's
    (each row causal over itself): each response sees its prompt and itself, nothing of another response."""
    (res,) = run_distributed(_attention_job, 1, timeout=120)
    assert res["scale"] > 0.1 and res["grad_scale"] > 0.1
    assert res["out"] <= 1e-5 * res["scale"] and res["grad"] <= 1e-5 * res["grad_scale"], res


def test_fixed_micro_batches_take_a_prompts_rows_together():
    b = _batch()
    units = prompt_groups(b)
    plan = split_batch(b, micro_batch_size=3, cost=real_tokens, units=units)
    assert [i.tolist() for i in plan.indices] == [[0, 2, 3], [1]]
    assert [i.tolist() for i in split_batch(b, micro_batch_size=3).indices] == [[0, 1, 2], [3]]


def test_dynamic_micro_batches_plan_over_groups_and_cut_those_over_the_budget():
    b = _batch()  # group 0: prompt 3 + responses 2 + 4 + 1 (the empty one counts a column) = 10; row 1: 5
    plan = split_batch(b, use_dynamic_bsz=True, max_token_len=10, cost=real_tokens, units=prompt_groups(b))
    assert sorted(i.tolist() for i in plan.indices) == [[0, 2, 3], [1]]
    plan = split_batch(b, use_dynamic_bsz=True, max_token_len=8, cost=real_tokens, units=prompt_groups(b))
    # 3 + 2 + 4 = 9 > 8: the group is cut after row 0 (a unit of 5 tokens) and rows 2, 3 (3 + 4 + 1 = 8) go on
    assert sorted(i.tolist() for i in plan.indices) == [[0], [1], [2, 3]]


def test_balanced_partitions_keep_groups_on_one_rank():
    from megappo.trainer.experience import balanced_partitions

    work = [10, 50, 12, 48, 30, 31, 5, 60]
    groups = [0, 1, 0, 1, 2, 2, 3, 3]  # 4 groups of 2
    parts = balanced_partitions(work, 2, groups)
    assert all({groups[i] for i in p} & {groups[i] for i in q} == set() for p, q in [parts])
    assert sorted(len(p) for p in parts) == [4, 4]
    assert balanced_partitions(work, 2, [0, 0, 0, 1, 1, 1, 2, 2]) == balanced_partitions(work, 2)  # uneven groups


def test_automatic_sharing_where_long_prompts_are_most_of_the_tokens():
    def group(p, rs):
        return ModelBatch.from_token_lists([[3] * p] * len(rs), [[4] * r for r in rs], pad_token_id=0)

    assert sharing_pays(group(1024, [64, 256] * 4))  # the benchmark's workload: 75% saved
    assert sharing_pays(group(256, [256, 512] * 4))  # 31% saved
    assert not sharing_pays(group(64, [512, 1024] * 4))  # 6%: slower shared
    assert not sharing_pays(group(MIN_PROMPT - 1, [1] * 8))  # tiny prompts stay unshared
    assert not sharing_pays(ModelBatch.from_token_lists([[3] * 900, [5] * 900], [[4], [4]], pad_token_id=0))
    # context-parallel tree rows attend densely over a group's row: long responses make it longer than it saves
    assert sharing_pays(group(1024, [64, 256] * 4), tree_rows=True)
    assert not sharing_pays(group(256, [256, 512] * 4), tree_rows=True)


def test_cp_tree_rows_run_each_prompt_once_and_read_back_as_each_row():
    """Under context parallelism a group is one row: the prompt less its last token, then per row a branch of that
    token and the response (one next-token label per position); outputs read back per row as the unshared rows'."""
    b = _batch().pad_to(5, 3, 4)  # and an all-padding row
    t = tree_rows(b)
    assert t.input_ids.tolist() == [[5, 6, 7, 11, 12, 7, 16, 17, 18, 19, 7],
                                    [8, 9, 13, 14, 15, 0, 0, 0, 0, 0, 0], [0] * 11]
    assert t.position_ids[0].tolist() == [0, 1, 2, 3, 4, 2, 3, 4, 5, 6, 2]
    assert t.segments.tolist() == [[0, 0, 1, 1, 1, 2, 2, 2, 2, 2, 3], [0] * 5 + [-1] * 6, [-1] * 11]
    plain = PlainRows(b)
    ids, pos = b.left_aligned()
    window = _response_window(b)

    real = b.response_mask.bool()
    assert real.sum() == 9
    # what a log-prob at a position depends on: its next token and its position
    for got, want in ((torch.roll(t.input_ids, -1, 1), torch.roll(ids, -1, 1)), (t.position_ids, pos)):
        assert torch.equal(t.window(got, window)[real], plain.window(want, window)[real])


def test_cp_tree_mask_lets_a_branch_see_its_prompt_and_itself_only():
    t = tree_rows(_batch())
    seg = torch.nn.functional.pad(t.segments, (0, 1), value=-1)  # 12 columns: 2 CP ranks x 2 chunks of 3
    full = [TreeRowParams(qkv_format="sbhd", segments=seg, cp_size=2, cp_rank=r).attend_mask("cpu") for r in (0, 1)]
    mask = torch.zeros(2, 12, 12, dtype=torch.bool)
    for r, m in enumerate(full):  # rank r holds chunks r and 3 - r
        mask[:, positions(12, 2, r)] = m[:, 0]
    row = mask[0]
    assert row[4].nonzero().squeeze(1).tolist() == [0, 1, 2, 3, 4]  # row 0's branch: prompt 5 6, then 7 11 12
    assert row[7].nonzero().squeeze(1).tolist() == [0, 1, 5, 6, 7]  # row 2's branch skips row 0's
    assert row[10].nonzero().squeeze(1).tolist() == [0, 1, 10]  # row 3 (empty response): its copy of 7
    assert torch.equal(mask[1, :5, :5], torch.ones(5, 5, dtype=torch.bool).tril())  # a row alone: causal


def test_refusals_name_the_fix():
    b = _batch()
    plain = torch.nn.Linear(1, 1)  # a module without megappo's attention
    assert "SDPAttention" in can_share(plain)
    assert "router replay" in can_share(plain, replaying=True)
    with pytest.raises(ValueError, match="use_prefix_sharing=false"):
        sharing_on(True, plain, 1, True, b)
    assert sharing_on(None, plain, 1, True, b) is False and sharing_on(False, plain, 1, True, b) is False


def test_config_key_defaults_follows_and_validates():
    from megappo.config.fields import ConfigError
    from megappo.config.loader import load_config
    from megappo.checks import validate

    cfg = load_config(None, ["actor_rollout_ref.model.path=/m"])
    assert cfg.actor_rollout_ref.model.use_prefix_sharing is None and cfg.critic.model.use_prefix_sharing is None
    cfg = load_config(None, ["actor_rollout_ref.model.path=/m", "actor_rollout_ref.model.use_prefix_sharing=false"])
    assert cfg.critic.model.use_prefix_sharing is False
    bad = load_config(None, ["actor_rollout_ref.model.path=/m", "actor_rollout_ref.model.use_prefix_sharing=true",
                             "actor_rollout_ref.model.use_remove_padding=false"])
    with pytest.raises(ConfigError, match="use_prefix_sharing"):
        validate(bad, world_size=1, check_files=False)
    cp = load_config(None, ["actor_rollout_ref.model.path=/m", "actor_rollout_ref.model.use_prefix_sharing=true",
                            "actor_rollout_ref.actor.megatron.context_parallel_size=2"])
    validate(cp, world_size=2, check_files=False)  # context-parallel micro-batches share as tree rows
    replay = load_config(None, ["actor_rollout_ref.model.path=/m", "actor_rollout_ref.model.use_prefix_sharing=true",
                                "actor_rollout_ref.actor.megatron.router_replay.mode=R2"])
    with pytest.raises(ConfigError, match="router_replay"):
        validate(replay, world_size=1, check_files=False)
