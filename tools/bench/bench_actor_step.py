"""Time and peak memory of an actor PPO step (forward + backward + Adam) of a small model on CPU, at TP1 and TP2.

The model is a random-weight Llama-shaped GPTModel built by megappo's builder (no download): 4 layers, hidden 256,
4 heads / 2 KV heads, vocabulary 32000 by default; the batch is 8 sequences of 128 prompt + 128 response tokens,
fp32, one micro-batch. Each layout runs in fresh gloo processes with one torch thread per rank. Printed per
layout: seconds per train step (forward + backward + optimizer, mean of --steps after one warm-up step), seconds
per forward-only log-prob pass, the peak resident set of the busiest rank and its growth over the steps.

    python tools/bench/bench_actor_step.py [--steps 3] [--vocab 32000] [--hidden 256] [--layers 4]
"""
from __future__ import annotations

import argparse
import resource
import time

import psutil
import torch


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _rank(rank: int, world_size: int, tp: int, args: dict):
    from megappo.kinds.build import build_model
    from megappo.models.batch import ModelBatch, TrainInputs
    from megappo.models.compute import MicroBatching, compute_log_probs, train_step
    from megappo.models.optim import OptimSettings, build_optimizer, build_scheduler, wrap_ddp
    from megappo.parallel import init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout
    from megappo.testing.hf_models import tiny_hf_config

    plat = detect_platform()
    ps = init_parallel(ParallelLayout(tp=tp), plat, seed=0)
    cfg = tiny_hf_config("llama", vocab_size=args["vocab"], hidden_size=args["hidden"],
                         intermediate_size=args["hidden"] * 2, num_hidden_layers=args["layers"])
    chunks = build_model(cfg.to_dict(), "actor", ps, plat)
    settings = OptimSettings(lr=1e-5, total_steps=100)
    ddp = wrap_ddp(chunks, settings, plat)
    opt = build_optimizer(ddp, settings, plat)
    sched = build_scheduler(opt, settings)

    g = torch.Generator().manual_seed(0)
    b, p, r = args["batch"], args["prompt"], args["response"]
    ids = torch.randint(0, args["vocab"], (b, p + r), generator=g)
    batch = ModelBatch.from_token_lists(ids[:, :p].tolist(), ids[:, p:].tolist(), pad_token_id=0)
    batch.train = TrainInputs(old_log_probs=torch.full((b, r), -10.0), advantages=torch.randn(b, r, generator=g))

    def loss_fn(out, ctx):
        m = ctx.batch.response_mask.float()
        ratio = torch.exp(out.log_probs - ctx.batch.train.old_log_probs)
        adv = ctx.batch.train.advantages
        pg = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
        return (pg * m).sum() / ctx.global_num_tokens, {}

    micro = MicroBatching()
    base = psutil.Process().memory_info().rss / 2**20
    train_step(ddp, opt, sched, batch, loss_fn, parallel_state=ps, micro=micro, platform=plat)  # warm-up
    t0 = time.perf_counter()
    for _ in range(args["steps"]):
        train_step(ddp, opt, sched, batch, loss_fn, parallel_state=ps, micro=micro, platform=plat)
    step_s = (time.perf_counter() - t0) / args["steps"]
    t0 = time.perf_counter()
    for _ in range(args["steps"]):
        compute_log_probs(ddp, batch, parallel_state=ps, micro=micro)
    fwd_s = (time.perf_counter() - t0) / args["steps"]
    return {"step_s": step_s, "fwd_s": fwd_s, "peak_mb": _peak_mb(), "growth_mb": _peak_mb() - base,
            "params": sum(p.numel() for c in ddp for p in c.parameters())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--response", type=int, default=128)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    args = vars(ap.parse_args())
    from megappo.testing.dist import run_distributed

    print(f"actor step: llama-shaped, layers {args['layers']} hidden {args['hidden']} vocab {args['vocab']}, "
          f"batch {args['batch']} x ({args['prompt']} + {args['response']}) tokens, fp32, CPU, 1 thread/rank")
    print(f"{'layout':<8}{'params/rank':>13}{'train step s':>14}{'log-prob fwd s':>16}{'peak RSS MiB':>14}"
          f"{'growth MiB':>12}")
    for tp in args["tp"]:
        res = run_distributed(_rank, tp, tp, args, timeout=900)
        worst = max(res, key=lambda x: x["peak_mb"])
        print(f"{'tp' + str(tp):<8}{res[0]['params']:>13,}{max(x['step_s'] for x in res):>14.2f}"
              f"{max(x['fwd_s'] for x in res):>16.2f}{worst['peak_mb']:>14.0f}{worst['growth_mb']:>12.0f}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
