"""Time megappo.algos.compute_gae against loop references at B=256, T=4096 (the issue-2 benchmark).

Prints, per implementation, the median wall time and the max abs difference to the plain loop:
  - megappo compute_gae: vectorised (reverse cumsum when gamma*lam == 1, log-depth linear scan otherwise)
  - time-loop: one step per token position, batched over rows (verl's formulation, O(T) tensor ops)
  - plain loop: one Python step per token, per row, on floats (the reference)

    python tools/bench/bench_gae.py [--batch 256] [--length 4096] [--threads 1]
"""

import argparse
import statistics
import time

import torch

from megappo.algos import compute_gae


def time_loop_gae(rewards, values, mask, gamma, lam):
    """verl-style reverse loop over time; each step is a few [B] tensor ops."""
    mask = mask.to(values.dtype)
    next_values = torch.zeros_like(values[:, 0])
    last_adv = torch.zeros_like(values[:, 0])
    out = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        adv = delta + gamma * lam * last_adv
        next_values = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_values
        last_adv = adv * mask[:, t] + (1 - mask[:, t]) * last_adv
        out.append(last_adv)
    advantages = torch.stack(out[::-1], dim=1)
    return advantages, advantages + values


def plain_loop_gae(rewards, values, mask, gamma, lam):
    """One Python step per token on lists of floats: the simplest correct reference."""
    r, v, m = rewards.tolist(), values.tolist(), mask.tolist()
    adv = []
    for rr, vv, mm in zip(r, v, m):
        row = [0.0] * len(rr)
        next_value = next_adv = 0.0
        for t in range(len(rr) - 1, -1, -1):
            if mm[t]:
                next_adv = rr[t] + gamma * next_value - vv[t] + gamma * lam * next_adv
                next_value = vv[t]
            row[t] = next_adv
        adv.append(row)
    advantages = torch.tensor(adv, dtype=values.dtype)
    return advantages, advantages + values


def bench(fn, args, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    gen = torch.Generator().manual_seed(0)
    B, T = args.batch, args.length
    rewards = torch.randn(B, T, generator=gen)
    values = torch.randn(B, T, generator=gen)
    # responses of random length with a few interior masked tokens, right-padded
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    mask = (torch.arange(T) < lengths[:, None]) & (torch.rand(B, T, generator=gen) > 0.05)
    print(f"compute_gae B={B} T={T} threads={args.threads} float32, {int(mask.sum())} valid tokens")

    for gamma, lam in [(1.0, 1.0), (0.99, 0.95)]:
        data = (rewards, values, mask, gamma, lam)
        t_ref, (ref, _) = bench(plain_loop_gae, data, 1)
        t_loop, (loop, _) = bench(time_loop_gae, data, 3)
        fast = lambda *a: compute_gae(*a[:3], gamma=a[3], lam=a[4])  # noqa: E731
        t_fast, (adv, _) = bench(fast, data, 5)
        print(f"gamma={gamma} lam={lam}")
        for name, t, out in [
            ("megappo compute_gae", t_fast, adv),
            ("time-loop (O(T) ops)", t_loop, loop),
            ("plain per-token loop", t_ref, ref),
        ]:
            err = (out - ref).abs().max().item()
            print(f"  {name:22s} {t * 1e3:10.1f} ms   x{t_ref / t:7.1f} vs plain   max|diff| {err:.2e}")


if __name__ == "__main__":
    main()
