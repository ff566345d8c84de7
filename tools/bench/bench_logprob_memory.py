"""Peak memory of per-token log-probs (+ entropy, forward and backward) at a 150k vocabulary.

Compares, each in a fresh process so peaks do not mix:
- full:   the whole [N, V] logits materialised, torch.log_softmax + gather (what a non-vocab-parallel trainer does);
- vp tp1: megappo's vocab-parallel function on one rank (no extra full-size log_softmax copy);
- vp tp2: the same at TP=2 (gloo), where each rank holds only its [N, V/2] logit shard.
Memory is the peak resident set (ru_maxrss) minus the resident set just before the measured region.

    python tools/bench/bench_logprob_memory.py [--tokens 1024] [--vocab 151936] [--hidden 256]
"""
from __future__ import annotations

import argparse
import resource
import time

import psutil
import torch


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _measure(rank: int, world_size: int, mode: str, tokens: int, vocab: int, hidden: int, entropy: bool):
    import torch.distributed as dist

    from megappo.models.vocab_parallel import vocab_parallel_log_probs_and_entropy

    g = torch.Generator().manual_seed(0)
    shard = vocab // world_size
    weight = torch.randn(shard, hidden, generator=g) * 0.02  # this rank's rows of the output layer [V/tp, H]
    hidden_states = torch.randn(tokens, hidden, generator=g).requires_grad_(True)  # [N, H]
    target = torch.randint(0, vocab, (tokens,), generator=g)
    group = dist.new_group(list(range(world_size))) if world_size > 1 else None
    base = _rss_mb()
    t0 = time.perf_counter()
    logits = hidden_states @ weight.t()  # [N, V/tp]
    if mode == "full":
        lsm = torch.log_softmax(logits, -1)
        logp = lsm.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        ent = -(lsm.exp() * lsm).sum(-1) if entropy else None
    else:
        logp, ent = vocab_parallel_log_probs_and_entropy(logits, target, group, calculate_entropy=entropy)
    loss = logp.sum() + (ent.sum() if ent is not None else 0)
    del logits  # the autograd graph does not keep it: only the function's own softmax buffer remains
    if mode == "full":
        del lsm
    loss.backward()
    elapsed = time.perf_counter() - t0
    return {"peak_delta_mb": _peak_mb() - base, "seconds": elapsed, "logp0": logp[0].item()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=151936)  # Qwen2's vocabulary
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--no-entropy", action="store_true")
    args = ap.parse_args()
    from megappo.testing.dist import run_distributed

    entropy = not args.no_entropy
    full_logits_mb = args.tokens * args.vocab * 4 / 2**20
    print(f"tokens {args.tokens} vocab {args.vocab} hidden {args.hidden} fp32, entropy {entropy}; "
          f"one full [N, V] fp32 logits tensor = {full_logits_mb:.0f} MiB")
    print(f"{'path':<28}{'peak MiB/rank':>15}{'x full logits':>15}{'seconds':>10}")
    for label, mode, world in (("full logits, log_softmax", "full", 1), ("vocab-parallel tp1", "vp", 1),
                               ("vocab-parallel tp2", "vp", 2)):
        res = run_distributed(_measure, world, mode, args.tokens, args.vocab, args.hidden, entropy, timeout=600)
        peak = max(r["peak_delta_mb"] for r in res)
        secs = max(r["seconds"] for r in res)
        print(f"{label:<28}{peak:>15.0f}{peak / full_logits_mb:>15.2f}{secs:>10.2f}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
