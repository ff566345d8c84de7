"""Prefix sharing (`actor_rollout_ref.model.use_prefix_sharing`) against the unshared packed path.

The workload: `--groups` prompts of `--prompt` tokens, `--n` responses each of `--resp-min`..`--resp-max` tokens
(uniform), a tiny Qwen2-style actor (random weights, hidden `--hidden`, `--layers` layers), `--micro` samples per
micro-batch (a group per micro-batch at the default n = micro = 8), packed (use_remove_padding) in both paths (with
`--cp` > 1: context-parallel padded rows, a group's as one tree row, on that many gloo ranks; rank 0's times). Timed:
the log-prob pass (`compute_log_probs`, forward only, as the reference and old-log-prob passes run it) and one
PPO-shaped training step (`train_step`: forward, log-probs and entropy, a token-mean loss, backward; lr 0).

Each path runs in a fresh process (world 1, gloo, one thread); the first pass of each kind warms up, the best of
the next `--repeats` is reported. tokens/s counts the batch's tokens as its rows hold them (every row's prompt +
response), the same for both paths, so the ratio is the speed-up.

    python tools/bench/bench_prefix_sharing.py [--prompt 1024] [--resp-min 64] [--resp-max 256] [--n 8]
    python tools/bench/bench_prefix_sharing.py --prompt 64 --resp-min 512 --resp-max 1024   # where it does not pay
    python tools/bench/bench_prefix_sharing.py --cp 2   # context parallelism: padded rows, a tree row per group
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch


def _batch(args, vocab: int):
    from megappo.models.batch import ModelBatch, TrainInputs

    g = torch.Generator().manual_seed(args.seed)
    prompts, responses = [], []
    for _ in range(args.groups):
        prompt = torch.randint(1, vocab, (args.prompt,), generator=g).tolist()
        for _ in range(args.n):
            r = int(torch.randint(args.resp_min, args.resp_max + 1, (1,), generator=g))
            prompts.append(prompt)
            responses.append(torch.randint(1, vocab, (r,), generator=g).tolist())
    b = ModelBatch.from_token_lists(prompts, responses, pad_token_id=0)
    b.train = TrainInputs(advantages=torch.randn(b.response_mask.shape, generator=g))
    return b, sum(len(p) + len(r) for p, r in zip(prompts, responses))


def _loss(out, ctx):
    m = ctx.batch.response_mask.float()
    pg = -(out.log_probs * ctx.batch.train.advantages * m).sum() / ctx.global_num_tokens
    ent = (out.entropy * m).sum() / ctx.global_num_tokens
    return pg - 0.01 * ent, {}


def _best(fn, repeats: int) -> tuple[float, object]:
    out = fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def _measure(rank: int, world: int, hf_dir: str, args, share) -> dict:
    from megappo.kinds.build import build_model
    from megappo.kinds.weights import load_hf_weights
    from megappo.models.compute import MicroBatching, compute_log_probs, train_step
    from megappo.models.hf_config import load_hf_config_dict
    from megappo.models.layout.plan import plan_micro_batches
    from megappo.models.optim import OptimSettings, build_optimizer, wrap_ddp
    from megappo.parallel import init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout

    torch.set_num_threads(1)
    plat = detect_platform()
    ps = init_parallel(ParallelLayout(cp=args.cp), plat, seed=0)
    chunks = build_model(hf_dir, "actor", ps, plat, seed=0)
    load_hf_weights(chunks, hf_dir, ps)
    settings = OptimSettings(lr=0.0, weight_decay=0.0, clip_grad=0.0, total_steps=2 * args.repeats + 2)
    ddp = wrap_ddp(chunks, settings, plat)
    opt = build_optimizer(ddp, settings, plat)
    batch, tokens = _batch(args, int(load_hf_config_dict(hf_dir)["vocab_size"]))
    micro = MicroBatching(micro_batch_size=args.micro, packed=True, share_prefix=share)
    layouts = plan_micro_batches(ddp, batch, micro, ps).layouts
    # the tokens the model runs: a pack's, or (context parallel) the padded rows' over every CP rank
    pack_tokens = sum(lay.pack.num_tokens if lay.pack is not None else lay.rows * lay.seq_length for lay in layouts)
    logp_s, (logp, _) = _best(lambda: compute_log_probs(ddp, batch, parallel_state=ps, micro=micro), args.repeats)
    step_s, m = _best(lambda: train_step(ddp, opt, None, batch, _loss, parallel_state=ps, micro=micro,
                                         calculate_entropy=True, platform=plat), args.repeats)
    name = {False: "packed", True: "shared", None: "auto"}[share]
    shared = [type(lay.pack).__name__ == "SharedPack" or type(getattr(lay, "layout_rows", None)).__name__ == "TreeRows"
              for lay in layouts]
    return {"path": name, "shared": any(shared),
            "pack_tokens": pack_tokens, "tokens": tokens, "logp_s": logp_s, "step_s": step_s,
            "logp_tokens_per_s": tokens / logp_s, "step_tokens_per_s": tokens / step_s, "loss": m.loss,
            "logp": logp, "device": "cuda" if plat.is_cuda else "cpu"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--n", type=int, default=8, help="responses per prompt (rollout.n)")
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens")
    ap.add_argument("--resp-min", type=int, default=64)
    ap.add_argument("--resp-max", type=int, default=256)
    ap.add_argument("--micro", type=int, default=8, help="samples per micro-batch")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cp", type=int, default=1, help="context-parallel ranks (tree rows, padded, `prefix_cp`)")
    ap.add_argument("--auto", action="store_true", help="also run use_prefix_sharing=None (the automatic choice)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    from megappo.testing import make_hf_model
    from megappo.testing.dist import run_distributed

    hf_dir = make_hf_model("qwen2", tempfile.mkdtemp(prefix="bench_prefix_"), tokenizer=False,
                           vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                           num_hidden_layers=args.layers, num_attention_heads=args.heads,
                           num_key_value_heads=max(1, args.heads // 2),
                           max_position_embeddings=max(2048, args.prompt + args.resp_max))
    print(f"{args.groups} prompts of {args.prompt} tokens x {args.n} responses of {args.resp_min}..{args.resp_max}; "
          f"hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; {args.micro} samples per micro-batch")
    modes = (False, True) + ((None,) if args.auto else ())
    results = [run_distributed(_measure, args.cp, hf_dir, args, share, timeout=1800)[0] for share in modes]
    print(f"{'path':<8}{'pack tok':>9}{'logp s':>9}{'logp tok/s':>12}{'step s':>9}{'step tok/s':>12}{'loss':>14}")
    for r in results:
        print(f"{r['path'] + ('' if r['shared'] else '*'):<8}{r['pack_tokens']:>9}{r['logp_s']:>9.2f}"
              f"{r['logp_tokens_per_s']:>12.0f}{r['step_s']:>9.2f}{r['step_tokens_per_s']:>12.0f}{r['loss']:>14.7f}")
    base, shared = results[0], results[1]
    diff = (shared["logp"] - base["logp"]).abs().max().item()
    print(f"shared / packed: log-prob pass {base['logp_s'] / shared['logp_s']:.2f}x, training step "
          f"{base['step_s'] / shared['step_s']:.2f}x tokens/s; {base['tokens']} row tokens run as "
          f"{shared['pack_tokens']}; max |log-prob diff| {diff:.1e}, loss rel. diff "
          f"{abs(shared['loss'] - base['loss']) / max(abs(base['loss']), 1e-12):.1e} on {base['device']} "
          "(* = ran unshared)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": [{k: v for k, v in r.items() if k != "logp"}
                                                       for r in results]}, f, indent=1)


if __name__ == "__main__":
    main()
