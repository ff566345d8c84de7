"""Padded vs packed (verl's use_remove_padding) forward + backward on a long-tailed length mix.

The workload: `--seqs` sequences with prompts of 16-64 tokens and responses of 8-1024 tokens drawn lognormal
(median `--median`, sigma `--sigma`), a tiny Qwen2-style actor (random weights), one PPO-shaped training step
(`megappo.models.compute.train_step`: forward, vocab-parallel log-probs and entropy, a token-mean loss, backward;
lr 0). The batch is cut the same way for both paths: `--micro` samples per micro-batch in arrival order (padded:
each micro-batch padded to its longest row; packed: the micro-batch is one pack), or with `--budget N` megappo's
dynamic micro-batches (use_dynamic_bsz; the budget counts padded tokens for the padded path, real ones packed).

Each path runs in a fresh process (world 1, gloo, one thread): the first step gives the peak memory (CPU: the peak
resident set minus the resident set just before the step; CUDA: `max_memory_allocated` minus the allocation before
it), the next `--repeats` steps the time. tokens/s counts real tokens (prompt + response), the same for both.
The same script runs on a GPU machine (CUDA is used when available: transformer-engine's THD attention there).

    python tools/bench/bench_packing.py [--seqs 32] [--micro 8] [--hidden 256] [--layers 4] [--budget N]
"""
from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time

import psutil
import torch


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def lengths(seqs: int, median: float, sigma: float, seed: int) -> tuple[list[int], list[int]]:
    """(prompt lengths 16..64, response lengths lognormal, clipped to 8..1024)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(16, 65, (seqs,), generator=g).tolist()
    resp = torch.exp(torch.randn(seqs, generator=g) * sigma + torch.log(torch.tensor(float(median))))
    return prompts, resp.round().clamp(8, 1024).long().tolist()


def _batch(args, vocab: int):
    from megappo.models.batch import ModelBatch, TrainInputs

    plens, rlens = lengths(args.seqs, args.median, args.sigma, args.seed)
    g = torch.Generator().manual_seed(args.seed + 1)
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in plens]
    responses = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in rlens]
    b = ModelBatch.from_token_lists(prompts, responses, pad_token_id=0)
    b.train = TrainInputs(advantages=torch.randn(b.response_mask.shape, generator=g))
    return b, sum(plens) + sum(rlens)


def _loss(out, ctx):
    m = ctx.batch.response_mask.float()
    pg = -(out.log_probs * ctx.batch.train.advantages * m).sum() / ctx.global_num_tokens
    ent = (out.entropy * m).sum() / ctx.global_num_tokens
    return pg - 0.01 * ent, {}


def _measure(rank: int, world: int, hf_dir: str, args, packed: bool) -> dict:
    from megappo.kinds.build import build_model
    from megappo.kinds.weights import load_hf_weights
    from megappo.models.compute import MicroBatching, train_step
    from megappo.models.hf_config import load_hf_config_dict
    from megappo.models.optim import OptimSettings, build_optimizer, wrap_ddp
    from megappo.parallel import init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout

    plat = detect_platform()
    ps = init_parallel(ParallelLayout(), plat, seed=0)
    cuda = plat.is_cuda
    chunks = build_model(hf_dir, "actor", ps, plat, seed=0)
    load_hf_weights(chunks, hf_dir, ps)
    settings = OptimSettings(lr=0.0, weight_decay=0.0, clip_grad=0.0, total_steps=args.repeats + 1)
    ddp = wrap_ddp(chunks, settings, plat)
    opt = build_optimizer(ddp, settings, plat)
    batch, real_tokens = _batch(args, int(load_hf_config_dict(hf_dir)["vocab_size"]))
    if args.budget:
        micro = MicroBatching(use_dynamic_bsz=True, max_token_len=args.budget, packed=packed)
    else:
        micro = MicroBatching(micro_batch_size=args.micro, packed=packed)

    def step():
        return train_step(ddp, opt, None, batch, _loss, parallel_state=ps, micro=micro, calculate_entropy=True,
                          platform=plat)

    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _rss_mb()
    m = step()
    if cuda:
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak = _peak_rss_mb() - base
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    secs = min(times)
    return {"path": "packed" if packed else "padded", "loss": m.loss, "grad_norm": m.grad_norm,
            "micro_batches": m.num_micro_batches, "seconds": secs, "tokens_per_s": real_tokens / secs,
            "peak_mb": peak, "real_tokens": real_tokens, "device": "cuda" if cuda else "cpu"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--micro", type=int, default=8, help="samples per micro-batch (one pack when packed)")
    ap.add_argument("--budget", type=int, default=0, help="use_dynamic_bsz with this token budget instead")
    ap.add_argument("--median", type=float, default=96.0, help="median response length")
    ap.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the response lengths")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    from megappo.testing import make_hf_model
    from megappo.testing.dist import run_distributed

    plens, rlens = lengths(args.seqs, args.median, args.sigma, args.seed)
    hf_dir = make_hf_model("qwen2", tempfile.mkdtemp(prefix="bench_packing_"), tokenizer=False,
                           vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                           num_hidden_layers=args.layers, num_attention_heads=args.heads,
                           num_key_value_heads=max(1, args.heads // 2), max_position_embeddings=2048)
    print(f"{args.seqs} sequences, responses {min(rlens)}..{max(rlens)} tokens (median {sorted(rlens)[len(rlens)//2]}),"
          f" {sum(plens) + sum(rlens)} real tokens; hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; "
          + (f"dynamic budget {args.budget}" if args.budget else f"{args.micro} samples per micro-batch"))
    results = [run_distributed(_measure, 1, hf_dir, args, packed, timeout=1800)[0] for packed in (False, True)]
    print(f"{'path':<8}{'micro':>7}{'seconds':>10}{'tokens/s':>11}{'peak MiB':>10}{'loss':>14}")
    for r in results:
        print(f"{r['path']:<8}{r['micro_batches']:>7}{r['seconds']:>10.2f}{r['tokens_per_s']:>11.0f}"
              f"{r['peak_mb']:>10.0f}{r['loss']:>14.7f}")
    pad, pk = results
    print(f"packed / padded: {pk['tokens_per_s'] / pad['tokens_per_s']:.2f}x tokens/s, "
          f"{pk['peak_mb'] / max(pad['peak_mb'], 1e-9):.2f}x peak memory; loss rel. diff "
          f"{abs(pk['loss'] - pad['loss']) / max(abs(pad['loss']), 1e-12):.1e} on {pad['device']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
