"""Rollout on CPU: generation throughput of the in-process engine, and weight-sync speed from a megatron actor.

The model is a random-weight Qwen2 written by megappo's test factory (no download): 8 layers, hidden 512,
vocabulary 32000 by default, fp32. Printed:
- generation: prompts x n sampled responses of --new-tokens tokens each (EOS ignored), tokens/s and seconds;
- weight sync: a world-1 megatron actor of the same model streams every tensor into the engine through
  `iter_hf_weights` (the trainer's path, in --bucket-mb buckets), GB/s; beside it, reloading the same weights from
  the safetensors files (`update_weights_from_disk`).

    python tools/bench/bench_rollout.py [--layers 8 --hidden 512 --vocab 32000] [--prompts 16 --n 2]
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from megappo.convert.export import iter_hf_weights
    from megappo.convert.hf_to_mcore import load_hf_weights
    from megappo.models.builder import build_model
    from megappo.models.hf_config import load_hf_config_dict
    from megappo.platform.layout import ParallelLayout
    from megappo.parallel import destroy_parallel, init_parallel
    from megappo.platform import detect_platform
    from megappo.rollout import HFEngine, SamplingParams
    from megappo.testing.hf_models import make_hf_model

    with tempfile.TemporaryDirectory(prefix="megappo_bench_rollout_") as work:
        hf_dir = make_hf_model("qwen2", f"{work}/hf", tokenizer=False, vocab_size=args.vocab,
                               hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                               num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                               num_key_value_heads=max(1, args.hidden // 256), max_position_embeddings=4096)
        engine = HFEngine(hf_dir)
        nbytes = sum(t.numel() * t.element_size() for t in engine.model.state_dict().values())
        print(f"model: qwen2 {args.layers} layers hidden {args.hidden} vocab {args.vocab} fp32, "
              f"{nbytes / 1e9:.3f} GB, {args.threads} threads", flush=True)

        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(1, args.vocab, (args.prompts, args.prompt_len), generator=g).tolist()
        params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, n=args.n, ignore_eos=True, seed=0)
        engine.generate(prompts[:2], SamplingParams(max_new_tokens=2, ignore_eos=True))  # warm-up
        t0 = time.time()
        out = engine.generate(prompts, params)
        seconds = time.time() - t0
        tokens = sum(len(c.output_ids) for group in out for c in group)
        print(f"generation: {args.prompts} prompts x n={args.n}, {args.prompt_len} prompt + {args.new_tokens} new "
              f"tokens: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.0f} tokens/s", flush=True)

        plat = detect_platform()
        ps = init_parallel(ParallelLayout(), plat, seed=0)
        actor = build_model(hf_dir, "actor", ps, plat)
        load_hf_weights(actor, hf_dir, ps)
        cfg = load_hf_config_dict(hf_dir)
        times = []
        for _ in range(3):  # the trainer syncs every step: the first sync pays page faults the later ones do not
            t0 = time.time()
            engine.update_weights(iter_hf_weights(actor, ps, cfg, bucket_bytes=args.bucket_mb << 20))
            times.append(time.time() - t0)
        steady = sum(times[1:]) / 2
        print(f"weight sync (megatron -> engine, {args.bucket_mb} MB buckets): {nbytes / 1e9:.3f} GB, first "
              f"{times[0]:.2f} s, then {steady:.2f} s = {nbytes / 1e9 / steady:.2f} GB/s", flush=True)
        t0 = time.time()
        engine.update_weights_from_disk(hf_dir)
        seconds = time.time() - t0
        print(f"weight reload from safetensors: {nbytes / 1e9:.3f} GB in {seconds:.2f} s = "
              f"{nbytes / 1e9 / seconds:.2f} GB/s", flush=True)
        destroy_parallel()


if __name__ == "__main__":
    main()
