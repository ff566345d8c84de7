"""Weight sync into a live vLLM server: rollout.weight_sync=distributed (megappo's worker extension, one broadcast
per bucket over the weight group: gloo on CPU) against disk (the server's `reload_weights` from a Hugging Face
directory, after megappo wrote it), on one server of a random-weight Qwen2.

    PYTHONPATH=. python tools/bench/bench_vllm_sync.py --vllm-python VENV/bin/python [--shape tiny|0.5b]

Prints, per mode and repeat, the seconds of the sync call (as the trainer's `load_weights` /
`update_weights_from_disk` spends them, prefix-cache reset and version label included) and the bytes per second;
for disk also the seconds to write the directory (`save_file`, which the distributed mode does not pay). The first
distributed sync includes joining the group (printed apart). Shapes: tiny (head_dim 32, 0.7 MB fp32)
and 0.5b (Qwen2.5-0.5B's: hidden 896, 24 layers, 14/2 heads, vocab 151936; 2 GB fp32: needs ~10 GB of host memory).
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

SHAPES = {
    "tiny": dict(num_attention_heads=2, num_key_value_heads=1),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936),
}


def buckets_of(weights: dict, bucket_bytes: int) -> list:
    out, cur, size = [], [], 0
    for name, t in weights.items():
        cur.append((name, t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            out.append(cur)
            cur, size = [], 0
    return out + ([cur] if cur else [])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--bucket-mb", type=float, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from safetensors.torch import load_file, save_file

    from megappo.rollout.vllm.fleet import VLLMFleet
    from megappo.rollout.vllm.server import VLLMServer
    from megappo.testing.hf_models import make_hf_model

    root = tempfile.mkdtemp(prefix="bench_vllm_sync_")
    model = make_hf_model("qwen2_tied", os.path.join(root, "m"), **SHAPES[args.shape])
    weights = load_file(os.path.join(model, "model.safetensors"))
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    buckets = buckets_of(weights, int(args.bucket_mb * 2**20))
    print(f"shape {args.shape}: {len(weights)} tensors, {nbytes / 2**20:.1f} MiB fp32, {len(buckets)} buckets")
    with VLLMServer(model, python=args.vllm_python, dtype="float32", cuda=False, max_model_len=128,
                    max_num_seqs=4) as server:
        fleet = VLLMFleet([server.url], api_key=server.api_key, sync_timeout=600)
        t0 = time.perf_counter()
        fleet.load_weights(iter(buckets), version=1)
        print(f"distributed, first (the group's join included): {time.perf_counter() - t0:.3f} s")
        version = 1
        for r in range(args.repeats):
            version += 1
            t0 = time.perf_counter()
            fleet.load_weights(iter(buckets), version=version)
            dt = time.perf_counter() - t0
            print(f"distributed #{r}: {dt:.3f} s, {nbytes / dt / 2**20:.1f} MiB/s")
        for r in range(args.repeats):
            version += 1
            out = os.path.join(root, f"disk{r}")
            os.makedirs(out)
            t0 = time.perf_counter()
            save_file(weights, os.path.join(out, "model.safetensors"))
            for f in ("config.json",):
                with open(os.path.join(model, f)) as src, open(os.path.join(out, f), "w") as dst:
                    dst.write(src.read())
            written = time.perf_counter() - t0
            t0 = time.perf_counter()
            fleet.update_weights_from_disk(out, version=version)
            dt = time.perf_counter() - t0
            print(f"disk #{r}: reload {dt:.3f} s ({nbytes / dt / 2**20:.1f} MiB/s), write {written:.3f} s")
        fleet.close()


if __name__ == "__main__":
    main()
