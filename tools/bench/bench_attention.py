"""Time a megatron GPTModel with megatron's local `DotProductAttention` (old) vs megappo's `SDPAttention` (new).

One random-weight Llama-shaped GPTModel built by megappo's builder (~30M parameters by default: hidden 512, 10
layers, 8 heads / 2 KV heads, ffn 1536, vocabulary 512), batch 16 x 92 tokens, fp32, one torch thread, one
process. The same weights run with either core attention: the old one is put back by replacing every layer's
`core_attention` with megatron's class and gets the explicit [1, 1, s, s] causal mask that class needs; the new
one gets no mask (as megappo's compute passes it). Repetitions alternate old / new so that load from other
processes hits both alike. Printed: median and best ms, old and new, and the speedup of the medians, of one
layer's core attention alone (forward, and forward + backward, on q/k/v of the model's shapes; 5x the repetitions)
and of the whole model (forward: no grad, eval mode, as log-prob passes run; forward + backward: train mode).

    python tools/bench/bench_attention.py [--reps 10] [--hidden 512] [--layers 10] [--heads 8] [--kv-heads 2]
        [--ffn 1536] [--vocab 512] [--batch 16] [--seq 92] [--threads 1]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=92)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megappo.kinds.build import build_model
    from megappo.models.attention import SDPAttention
    from megappo.models.builder import count_parameters
    from megappo.parallel import destroy_parallel, init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout
    from megappo.testing.hf_models import tiny_hf_config

    plat = detect_platform()
    ps = init_parallel(ParallelLayout(), plat, seed=0)
    cfg = tiny_hf_config("llama", vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads)
    (model,) = build_model(cfg.to_dict(), "actor", ps, plat, seed=0, make_vocab_size_divisible_by=1)
    model.to(plat.device)
    attn = [layer.self_attention for layer in model.decoder.layers]
    new_cores = [sa.core_attention for sa in attn]
    assert all(isinstance(c, SDPAttention) for c in new_cores), "the builder did not swap in SDPAttention"
    old_cores = [DotProductAttention(config=sa.config, layer_number=sa.layer_number, attn_mask_type=sa.attn_mask_type,
                                     attention_type="self", softmax_scale=sa.config.softmax_scale,
                                     pg_collection=sa.pg_collection) for sa in attn]

    b, s = args.batch, args.seq
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (b, s), generator=g).to(plat.device)
    pos = torch.arange(s, device=plat.device).unsqueeze(0).expand(b, s)
    causal = torch.ones(s, s, dtype=torch.bool, device=plat.device).triu_(1).view(1, 1, s, s)

    def use(cores):
        for sa, core in zip(attn, cores):
            sa.core_attention = core

    def sync():
        if plat.device.type == "cuda":
            torch.cuda.synchronize()

    def fwd(mask):
        model.eval()
        with torch.no_grad():
            model(input_ids=ids, position_ids=pos, attention_mask=mask)

    def fwd_bwd(mask):
        model.train()
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, position_ids=pos, attention_mask=mask).float().mean().backward()

    # one layer's core attention alone, on q/k/v of this model's shapes ([s, b, heads, head_dim])
    hd = cfg.hidden_size // args.heads
    q = torch.randn(s, b, args.heads, hd, generator=g).to(plat.device)
    k, v = (torch.randn(s, b, args.kv_heads, hd, generator=g).to(plat.device) for _ in range(2))

    def core_fwd(core, mask):
        with torch.no_grad():
            core(q, k, v, mask)

    def core_fwd_bwd(core, mask):
        qi, ki, vi = (t.clone().requires_grad_(True) for t in (q, k, v))
        core(qi, ki, vi, mask).sum().backward()

    variants = {"old": (old_cores, causal), "new": (new_cores, None)}
    benches = [
        ("core attention forward (1 layer)", lambda cores, mask: core_fwd(cores[0], mask)),
        ("core attention forward+backward (1 layer)", lambda cores, mask: core_fwd_bwd(cores[0], mask)),
        ("model forward", lambda cores, mask: fwd(mask)),
        ("model forward+backward", lambda cores, mask: fwd_bwd(mask)),
    ]
    results: dict[tuple[str, str], list[float]] = {}
    for kind, fn in benches:
        reps = args.reps * 5 if kind.startswith("core") else args.reps
        for name, (cores, mask) in variants.items():  # warm-up
            use(cores)
            fn(cores, mask)
        for _ in range(reps):
            for name, (cores, mask) in variants.items():
                use(cores)
                sync()
                t0 = time.perf_counter()
                fn(cores, mask)
                sync()
                results.setdefault((kind, name), []).append((time.perf_counter() - t0) * 1e3)

    print(f"GPTModel {count_parameters([model]) / 1e6:.1f}M params: hidden {args.hidden} layers {args.layers} "
          f"heads {args.heads}/{args.kv_heads} ffn {args.ffn} vocab {args.vocab}; batch {b} x seq {s}, fp32, "
          f"{torch.get_num_threads()} thread(s), device {plat.device}, torch {torch.__version__}, {args.reps} reps")
    for kind, _ in benches:
        old, new = results[(kind, "old")], results[(kind, "new")]
        mo, mn = statistics.median(old), statistics.median(new)
        print(f"{kind:>41}: old (DotProductAttention) median {mo:7.1f} ms best {min(old):7.1f} ms | "
              f"new (SDPAttention) median {mn:7.1f} ms best {min(new):7.1f} ms | speedup x{mo / mn:.2f}")
    destroy_parallel()


if __name__ == "__main__":
    main()
