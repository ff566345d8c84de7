"""Full-parameter vs LoRA actor step: trainable state (gradients + Adam moments) and step time, on CPU.

The model is a random-weight GPTModel with Qwen2.5-0.5B's widths by default (hidden 896, ffn 4864, 14 heads / 2 KV
heads, vocabulary 151936, tied embeddings) and 28 layers instead of 24: 554M parameters (Qwen2.5-0.5B itself has
494M), fp32, TP1, one torch thread, one process per
configuration (fresh memory). The batch is --batch sequences of --prompt + --response tokens, one micro-batch.
Printed per configuration: trainable parameters, the bytes of the gradient buffers and of the optimizer state
(measured from megatron's grad buffers and Adam's state tensors), seconds per train step (forward + backward +
optimizer; mean of --steps after one warm-up step) and the peak resident set.

    python tools/bench/bench_lora.py [--ranks 8 64] [--steps 2] [--batch 2] [--prompt 64] [--response 64]
"""
from __future__ import annotations

import argparse
import resource
import time

import torch


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _run(rank: int, world_size: int, lora_rank: int, args: dict):
    from megappo.config.schema import LoRAConfig
    from megappo.kinds.build import build_model
    from megappo.models.batch import ModelBatch, TrainInputs
    from megappo.models.compute import MicroBatching, train_step
    from megappo.models.lora import apply_lora
    from megappo.models.optim import OptimSettings, build_optimizer, build_scheduler, wrap_ddp
    from megappo.parallel import init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout
    from megappo.testing.hf_models import tiny_hf_config
    from megappo.trainer.settings import lora_settings

    plat = detect_platform()
    ps = init_parallel(ParallelLayout(), plat, seed=0)
    cfg = tiny_hf_config("qwen2", vocab_size=args["vocab"], hidden_size=args["hidden"],
                         intermediate_size=args["ffn"], num_hidden_layers=args["layers"],
                         num_attention_heads=args["heads"], num_key_value_heads=args["kv_heads"],
                         tie_word_embeddings=True, max_position_embeddings=4096)
    chunks = build_model(cfg.to_dict(), "actor", ps, plat)
    if lora_rank:
        apply_lora(chunks, lora_settings(LoRAConfig(rank=lora_rank, alpha=2.0 * lora_rank)))
    settings = OptimSettings(lr=1e-5, total_steps=100)
    ddp = wrap_ddp(chunks, settings, plat)
    opt = build_optimizer(ddp, settings, plat)
    sched = build_scheduler(opt, settings)

    g = torch.Generator().manual_seed(0)
    b, p, r = args["batch"], args["prompt"], args["response"]
    ids = torch.randint(1, args["vocab"], (b, p + r), generator=g)
    batch = ModelBatch.from_token_lists(ids[:, :p].tolist(), ids[:, p:].tolist(), pad_token_id=0)
    batch.train = TrainInputs(old_log_probs=torch.full((b, r), -12.0), advantages=torch.randn(b, r, generator=g))

    def loss_fn(out, ctx):
        m = ctx.batch.response_mask.float()
        ratio = torch.exp(out.log_probs - ctx.batch.train.old_log_probs)
        return -(ratio.clamp(0.8, 1.2) * ctx.batch.train.advantages * m).sum() / ctx.global_num_tokens, {}

    micro = MicroBatching()
    train_step(ddp, opt, sched, batch, loss_fn, parallel_state=ps, micro=micro, platform=plat)  # warm-up
    t0 = time.perf_counter()
    for _ in range(args["steps"]):
        train_step(ddp, opt, sched, batch, loss_fn, parallel_state=ps, micro=micro, platform=plat)
    step_s = (time.perf_counter() - t0) / args["steps"]
    params = [p for c in ddp for p in c.parameters()]
    trainable = [p for p in params if p.requires_grad]
    grads = [p.main_grad for p in trainable if getattr(p, "main_grad", None) is not None]
    states = [t for opt_ in getattr(opt, "chained_optimizers", [opt]) for s in opt_.optimizer.state.values()
              for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    return {"params": sum(p.numel() for p in params), "trainable": sum(p.numel() for p in trainable),
            "grad_bytes": _nbytes(grads), "optim_bytes": _nbytes(states), "step_s": step_s,
            "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64], help="LoRA ranks (full training always runs)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--ffn", type=int, default=4864)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", dest="kv_heads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--response", type=int, default=64)
    args = vars(ap.parse_args())
    from megappo.testing.dist import run_distributed

    print(f"actor step, qwen2-shaped: layers {args['layers']} hidden {args['hidden']} ffn {args['ffn']} vocab "
          f"{args['vocab']}, batch {args['batch']} x ({args['prompt']} + {args['response']}) tokens, fp32, CPU, "
          "1 thread", flush=True)
    print(f"{'config':<10}{'params':>14}{'trainable':>13}{'grads MiB':>11}{'Adam MiB':>10}{'state %full':>12}"
          f"{'step s':>9}{'x full':>8}{'peak RSS MiB':>14}", flush=True)
    full = None
    for lora_rank in [0, *args["ranks"]]:
        res = run_distributed(_run, 1, lora_rank, args, timeout=1800)[0]
        state = res["grad_bytes"] + res["optim_bytes"]
        if full is None:
            full = (state, res["step_s"])
        name = "full" if lora_rank == 0 else f"lora r{lora_rank}"
        print(f"{name:<10}{res['params']:>14,}{res['trainable']:>13,}{res['grad_bytes'] / 2**20:>11.1f}"
              f"{res['optim_bytes'] / 2**20:>10.1f}{100 * state / full[0]:>11.2f}%{res['step_s']:>9.2f}"
              f"{res['step_s'] / full[1]:>8.2f}{res['peak_mb']:>14.0f}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
