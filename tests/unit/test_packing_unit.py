"""`megappo.models.layout.packing`: a micro-batch's rows concatenated without padding, and read back; the packed token
budget of `split_batch`."""
from __future__ import annotations

import torch

from megappo.models.batch import ModelBatch
from megappo.models.microbatch import plan_groups, real_tokens, split_batch
from megappo.models.layout.packing import pack_lengths, pack_micro_batch, unpack_window


def _batch():
    prompts = [[5, 6], [7], [8, 9, 10]]
    responses = [[11, 12, 13], [14], []]
    return ModelBatch.from_token_lists(prompts, responses, pad_token_id=0)


def test_pack_concatenates_real_tokens_with_per_sequence_positions():
    b = _batch()
    assert pack_lengths(b).tolist() == [5, 2, 3]
    p = pack_micro_batch(b)
    assert p.input_ids.tolist() == [[5, 6, 11, 12, 13, 7, 14, 8, 9, 10]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 0, 1, 2]]
    assert p.cu_seqlens.tolist() == [0, 5, 7, 10] and p.cu_seqlens.dtype == torch.int32
    assert p.max_seqlen == 5 and p.starts.tolist() == [0, 5, 7]
    params = p.packed_seq_params()
    assert params.qkv_format == "thd" and params.max_seqlen_q == params.max_seqlen_kv == 5


def test_pack_tail_padding_is_its_own_sequence():
    b = _batch()
    p = pack_micro_batch(b, pack_len=12, multiple=8)  # 10 real tokens -> 16
    assert p.num_tokens == 16 and p.cu_seqlens.tolist() == [0, 5, 7, 10, 16]
    assert p.input_ids[0, 10:].tolist() == [0] * 6 and p.position_ids[0, 10:].tolist() == [0] * 6
    assert pack_micro_batch(b, multiple=4).num_tokens == 12
    padded = b.pad_to(4, 5, 4)  # an all-padding row adds no tokens
    assert pack_micro_batch(padded).input_ids.tolist() == pack_micro_batch(b).input_ids.tolist()


def test_unpack_window_reads_each_rows_columns_and_clamps_padding():
    b = _batch()
    p = pack_micro_batch(b)
    out = torch.arange(p.num_tokens, dtype=torch.float32).view(1, -1)  # output value = pack position
    window = torch.tensor([[1, 2, 3], [0, 1, 2], [2, 3, 4]])
    got = unpack_window(out, p, window)
    # row 0: pack 0..4; row 1: pack 5..6 (cols past its 2 tokens read its last); row 2: pack 7..9
    assert got.tolist() == [[1, 2, 3], [5, 6, 6], [9, 9, 9]]
    logits = torch.randn(1, p.num_tokens, 7)
    assert torch.equal(unpack_window(logits, p, window)[0], logits[0, 1:4])


def test_packed_budget_counts_real_tokens():
    plen, rlen = [2, 2, 2, 2], [30, 2, 2, 2]
    assert plan_groups(plen, rlen, 40) == [[0], [1, 2, 3]]  # padded: 2 rows x 32 > 40
    assert plan_groups(plen, rlen, 43, cost=real_tokens) == [[0, 1, 2], [3]]  # 32 + 4 + 4 = 40 <= 43 < 44
    assert len(plan_groups(plen, rlen, 48, cost=real_tokens)) == 1
    b = ModelBatch.from_token_lists([[1, 2]] * 4, [[3] * n for n in rlen], pad_token_id=0)
    assert len(split_batch(b, use_dynamic_bsz=True, max_token_len=48, cost=real_tokens)) == 1
    assert len(split_batch(b, use_dynamic_bsz=True, max_token_len=48)) == 2
