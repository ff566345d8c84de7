"""Vocab-parallel log-probs and entropy against a full-vocabulary reference, in one process and at TP=2 (gloo)."""
from __future__ import annotations

import pytest
import torch

from megappo.models import vocab_parallel
from megappo.models.vocab_parallel import vocab_parallel_log_probs, vocab_parallel_log_probs_and_entropy
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
    # lists, not tensors: torch.multiprocessing hands tensors over as shared-memory handles that die with the rank
    return [[t.tolist() for t in full], [t.tolist() for t in padded]]


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
