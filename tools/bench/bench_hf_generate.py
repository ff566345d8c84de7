"""Generation seconds of megappo's in-process engine (`HFEngine.generate`) beside TRL's PPO generation
(`trl.experimental.ppo.ppo_trainer.batch_generation`, i.e. `transformers`' `generate`) on the same model and prompts.

The workload is bench_ppo_iteration's "varlen" rollout: its 3.4M-parameter Qwen2 policy with the EOS row shaped for
lognormal response lengths (median ~50, up to 512), 16 equal-length chat prompts, temperature 1, EOS honoured. Both
sides sample the same prompts (not the same tokens: each side has its own random streams), so each prints its
response lengths beside its seconds; tokens/s counts generated tokens. Shaping the EOS row takes a few minutes:
--work DIR keeps the shaped model there for the next run.

    python tools/bench/bench_hf_generate.py [--work /tmp/varlen] [--repeats 3] [--threads 1] [--skip-trl]
        [--batch 16] [--max-num-seqs 64] [--profile]

Each side runs --repeats times, interleaved, and the best run is reported (others share the machine: the fastest
run is the one least slowed by them). --profile adds the engine's time in model forwards against the rest
(sampling, bookkeeping), per decode step, from a forward pre/post hook.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def build(work: str, batch: int, max_len: int) -> tuple[str, list[list[int]]]:
    """The varlen policy (shaped once, kept in `work`) and `batch` prompts of it."""
    from transformers import AutoTokenizer

    import bench_ppo_iteration as ppo
    from megappo.testing import make_hf_model

    size = ppo.SIZES["varlen"]
    policy = os.path.join(work, "policy")
    marker = os.path.join(work, "shaped")
    if not os.path.exists(marker):
        make_hf_model("qwen2", policy, seed=0, **size["model"])
        tok = AutoTokenizer.from_pretrained(policy)
        # the PPO bench shapes on its (steps + 1) batches' prompts; 4 batches is its default
        shaped = ppo.shape_eos(policy, ppo.make_prompts(tok, size["batch"] * 4)[1], size["eos"]["median"],
                               size["eos"]["sigma"], max_len)
        print(f"EOS shaped: {shaped}", flush=True)
        open(marker, "w").close()
    tok = AutoTokenizer.from_pretrained(policy)
    return policy, ppo.make_prompts(tok, batch)[1]


def run_engine(policy: str, prompts, max_len: int, max_num_seqs: int, seed: int, profile: bool) -> dict:
    from megappo.rollout import HFEngine, SamplingParams

    engine = HFEngine(policy, max_num_seqs=max_num_seqs)
    params = SamplingParams(max_new_tokens=max_len, temperature=1.0, seed=seed)
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=4, temperature=1.0, seed=0))  # warm-up
    fwd = {"s": 0.0, "calls": 0, "rows": 0}
    hooks = []
    if profile:
        def pre(module, args, kwargs):
            fwd["t0"] = time.perf_counter()
            fwd["rows"] += int(kwargs["input_ids"].shape[0])

        def post(module, args, kwargs, out):
            fwd["s"] += time.perf_counter() - fwd["t0"]
            fwd["calls"] += 1

        hooks = [engine.model.register_forward_pre_hook(pre, with_kwargs=True),
                 engine.model.register_forward_hook(post, with_kwargs=True)]
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)
    seconds = time.perf_counter() - t0
    for h in hooks:
        h.remove()
    lengths = [len(c.output_ids) for g in out for c in g]
    res = {"s": seconds, "tokens": sum(lengths), "lengths": lengths}
    if profile:
        res.update(forward_s=fwd["s"], forwards=fwd["calls"], forward_rows=fwd["rows"])
    return res


def run_trl(policy: str, prompts, max_len: int, batch: int) -> dict:
    import torch
    import trl.experimental.ppo.ppo_trainer as ppo_mod
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(policy, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
    # PPOTrainer's own generation config (temperature 1 + 1e-7, no top-k / top-p, sampling)
    config = GenerationConfig(max_new_tokens=max_len, temperature=1.0 + 1e-7, top_k=0.0, top_p=1.0, do_sample=True)
    queries = torch.tensor(prompts)
    ppo_mod.batch_generation(model, queries[:2], 2, tok.pad_token_id,
                             GenerationConfig(max_new_tokens=4, do_sample=True))  # warm-up
    t0 = time.perf_counter()
    with torch.no_grad():
        seqs, _ = ppo_mod.batch_generation(model, queries, batch, tok.pad_token_id, config)
    seconds = time.perf_counter() - t0
    resp = seqs[:, queries.shape[1]:]
    hit = resp == tok.eos_token_id
    lengths = torch.where(hit.any(1), hit.float().argmax(1) + 1, torch.full((len(prompts),), resp.shape[1]))
    return {"s": seconds, "tokens": int(lengths.sum()), "lengths": lengths.tolist(), "width": resp.shape[1]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/megappo_bench_hf_generate")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--skip-trl", action="store_true")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    os.makedirs(args.work, exist_ok=True)
    policy, prompts = build(args.work, args.batch, args.max_len)
    print(f"{len(prompts)} prompts x {len(prompts[0])} tokens, up to {args.max_len} new tokens, "
          f"{args.threads} thread(s), torch {torch.__version__}, load {os.getloadavg()[0]:.2f}", flush=True)
    runs: dict[str, list[dict]] = {"megappo": [], "TRL": []}
    for i in range(args.repeats):
        runs["megappo"].append(run_engine(policy, prompts, args.max_len, args.max_num_seqs, seed=i,
                                          profile=args.profile))
        if not args.skip_trl:
            torch.manual_seed(i)
            runs["TRL"].append(run_trl(policy, prompts, args.max_len, args.batch))
        for side, rs in runs.items():
            if rs:
                r = rs[-1]
                extra = "".join(f", {k} {r[k]:.3f}" if isinstance(r[k], float) else f", {k} {r[k]}"
                                for k in ("forward_s", "forwards", "forward_rows", "width") if k in r)
                if "forward_s" in r:  # what the loop costs beside the model: sampling, bookkeeping
                    extra += f", outside forwards {(r['s'] - r['forward_s']) / r['forwards'] * 1e3:.3f} ms/step"
                print(f"  run {i + 1} {side:>8}: {r['s']:.3f} s, {r['tokens']} tokens "
                      f"({r['tokens'] / r['s']:.0f} tok/s), longest {max(r['lengths'])}{extra}", flush=True)
    best = {side: min(rs, key=lambda r: r["s"]) for side, rs in runs.items() if rs}
    for side, r in best.items():
        print(f"best {side:>8}: {r['s']:.3f} s ({r['tokens']} tokens, {r['tokens'] / r['s']:.0f} tok/s)")
    if len(best) == 2:
        print(f"TRL / megappo: {best['TRL']['s'] / best['megappo']['s']:.2f}x (seconds per generation; "
              f"per token: {best['TRL']['s'] / best['TRL']['tokens'] / (best['megappo']['s'] / best['megappo']['tokens']):.2f}x)")


if __name__ == "__main__":
    main()
