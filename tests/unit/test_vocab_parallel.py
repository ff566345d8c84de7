"""Vocab-parallel log-probs, entropy and sum_v p_v^2 against a full-vocabulary reference, in one process and at TP=2
(gloo)."""
from __future__ import annotations

import pytest
import torch

from megappo.models import vocab_parallel
from megappo.models.vocab_parallel import (
    vocab_parallel_log_probs, vocab_parallel_log_probs_and_entropy, vocab_parallel_token_stats,
)
from megappo.testing.dist import run_distributed

B, S, V = 3, 5, 64


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, S, V, generator=g) * 4  # wide spread so some probabilities underflow-ish
    target = torch.randint(0, V, (B, S), generator=g)
    g_logp = torch.randn(B, S, generator=g)
    g_ent = torch.randn(B, S, generator=g)
    return logits, target, g_logp, g_ent


def _reference(logits, target, g_logp, g_ent, vocab_size=None):
    x = logits.clone().requires_grad_(True)
    lsm = torch.log_softmax(x[..., :vocab_size], -1)
    logp = lsm.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    ent = -(lsm.exp() * lsm).sum(-1)
    ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
    return logp.detach(), ent.detach(), x.grad


def _vp(logits_shard, target, g_logp, g_ent, group, entropy=True, vocab_size=None):
    x = logits_shard.clone().requires_grad_(True)
    logp, ent = vocab_parallel_log_probs_and_entropy(x, target, group, calculate_entropy=entropy,
                                                     vocab_size=vocab_size)
    loss = (logp * g_logp).sum() + ((ent * g_ent).sum() if entropy else 0)
    loss.backward()
    return logp.detach(), None if ent is None else ent.detach(), x.grad


@pytest.mark.parametrize("chunk_bytes", [64 << 20, 4 * V * 2])  # one chunk, and 2-row chunks
def test_single_rank_matches_full_vocab(monkeypatch, chunk_bytes):
    monkeypatch.setattr(vocab_parallel, "CHUNK_BYTES", chunk_bytes)
    logits, target, g_logp, g_ent = _inputs()
    ref = _reference(logits, target, g_logp, g_ent)
    got = _vp(logits, target, g_logp, g_ent, None)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_log_probs_only_gradient_and_bf16():
    logits, target, g_logp, _ = _inputs(1)
    x = logits.clone().requires_grad_(True)
    (torch.log_softmax(x, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1) * g_logp).sum().backward()
    logp, _, grad = _vp(logits, target, g_logp, None, None, entropy=False)
    torch.testing.assert_close(grad, x.grad, rtol=1e-5, atol=1e-6)
    xb = logits.bfloat16().requires_grad_(True)
    lp = vocab_parallel_log_probs(xb, target, None)
    assert lp.dtype == torch.float32
    lp.sum().backward()
    assert xb.grad.dtype == torch.bfloat16
    ref = torch.log_softmax(logits.bfloat16().float(), -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(lp, ref, rtol=1e-5, atol=1e-5)


def _sum_pi_squared_reference(logits, vocab_size=None):
    return torch.softmax(logits[..., :vocab_size].float(), -1).pow(2).sum(-1)


def _vp_sq(logits_shard, target, group, entropy, vocab_size=None):
    """(log_probs, entropy or None, sum_pi_squared) with the sum asked for; the sum carries no gradient."""
    x = logits_shard.clone().requires_grad_(True)
    logp, ent, sq = vocab_parallel_token_stats(x, target, group, calculate_entropy=entropy,
                                               calculate_sum_pi_squared=True, vocab_size=vocab_size)
    assert not sq.requires_grad
    return [t.detach() for t in (logp, ent, sq) if t is not None]


@pytest.mark.parametrize("chunk_bytes", [64 << 20, 4 * V * 2])
@pytest.mark.parametrize("entropy", [True, False])
@pytest.mark.parametrize("vocab_size", [None, 50])
def test_sum_pi_squared_single_rank(monkeypatch, chunk_bytes, entropy, vocab_size):
    monkeypatch.setattr(vocab_parallel, "CHUNK_BYTES", chunk_bytes)
    logits, target, g_logp, g_ent = _inputs(3)
    target = target % (vocab_size or V)
    got = _vp_sq(logits, target, None, entropy, vocab_size)
    torch.testing.assert_close(got[-1], _sum_pi_squared_reference(logits, vocab_size), rtol=1e-5, atol=1e-7)
    ref_logp, ref_ent, _ = _reference(logits, target, g_logp, g_ent, vocab_size)
    torch.testing.assert_close(got[0], ref_logp, rtol=1e-5, atol=1e-6)
    if entropy:
        torch.testing.assert_close(got[1], ref_ent, rtol=1e-5, atol=1e-6)
    # asking for the sum changes neither the log-probs' gradient nor the bf16 path
    x = logits.clone().requires_grad_(True)
    logp = vocab_parallel_token_stats(x, target, None, calculate_sum_pi_squared=True, vocab_size=vocab_size)[0]
    logp.sum().backward()
    y = logits.clone().requires_grad_(True)
    vocab_parallel_log_probs(y, target, None, vocab_size=vocab_size).sum().backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=0)
    sq_bf16 = vocab_parallel_token_stats(logits.bfloat16(), target, None, calculate_sum_pi_squared=True,
                                         vocab_size=vocab_size)[2]
    assert sq_bf16.dtype == torch.float32
    torch.testing.assert_close(sq_bf16, _sum_pi_squared_reference(logits.bfloat16(), vocab_size), rtol=1e-5,
                               atol=1e-7)


def test_sum_pi_squared_not_asked_is_none():
    logits, target, _, _ = _inputs(4)
    assert vocab_parallel_token_stats(logits, target, None)[2] is None


def test_shape_mismatch_is_named():
    with pytest.raises(ValueError, match="target's shape"):
        vocab_parallel_log_probs(torch.zeros(2, 3, 8), torch.zeros(2, 4, dtype=torch.long), None)


PADDED_VOCAB = 30  # rank 0's shard is partly padding, rank 1's entirely


def _tp2_worker(rank, world_size):
    import torch.distributed as dist

    logits, target, g_logp, g_ent = _inputs(2)
    shard = V // world_size
    group = dist.new_group(list(range(world_size)))
    mine = logits[..., rank * shard:(rank + 1) * shard]
    full = _vp(mine, target, g_logp, g_ent, group)
    padded = _vp(mine, target % PADDED_VOCAB, g_logp, g_ent, group, vocab_size=PADDED_VOCAB)
    # sum_v p^2 with and without the entropy, on the full and the padded vocabulary
    squares = [_vp_sq(mine, t, group, ent, vocab)[-1] for ent in (True, False)
               for t, vocab in ((target, None), (target % PADDED_VOCAB, PADDED_VOCAB))]
    # lists, not tensors: torch.multiprocessing hands tensors over as shared-memory handles that die with the rank
    return [[t.tolist() for t in full], [t.tolist() for t in padded], [t.tolist() for t in squares]]


@pytest.mark.multirank  # two gloo ranks in subprocesses
def test_tp2_matches_full_vocab():
    logits, target, g_logp, g_ent = _inputs(2)
    results = run_distributed(_tp2_worker, 2, timeout=120)
    for which, (tgt, vocab) in enumerate([(target, None), (target % PADDED_VOCAB, PADDED_VOCAB)]):
        ref_logp, ref_ent, ref_grad = _reference(logits, tgt, g_logp, g_ent, vocab)
        grads = []
        for res in results:
            logp, ent, grad = (torch.tensor(t) for t in res[which])
            torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-6)
            grads.append(grad)
        grad = torch.cat(grads, -1)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)  # padding columns: exactly 0 in both


@pytest.mark.multirank  # two gloo ranks in subprocesses
def test_tp2_sum_pi_squared_matches_full_vocab():
    logits = _inputs(2)[0]
    refs = [_sum_pi_squared_reference(logits, vocab) for vocab in (None, PADDED_VOCAB)] * 2
    for res in run_distributed(_tp2_worker, 2, timeout=120):
        for got, ref in zip(res[2], refs):
            torch.testing.assert_close(torch.tensor(got), ref, rtol=1e-5, atol=1e-7)
