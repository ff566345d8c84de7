"""Benchmark checkpoint conversion both ways on CPU: GB/s and peak resident memory.

    python tools/bench/bench_convert.py [--layers 12 --hidden 2048 --vocab 32000 --dtype bf16] [--workdir /tmp/x]

Writes a random-weight Llama checkpoint (default 1.33 GB in bf16) straight to safetensors, then runs, each as its
own process: `megappo convert hf-to-mcore` (with 128MB and the default 512MB write buckets), `mcore-to-hf`
(streamed from the checkpoint files) and
`mcore-to-hf --from-model` (the trainer's weight-sync path), sampling the resident memory (PSS: pages shared with
forked workers counted once) of each process tree every 100 ms; finally checks that both exports are bit-identical
to the source. Prints one line per step. The work directory is deleted at the end (unless --keep).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch


def make_checkpoint(path: str, layers: int, hidden: int, vocab: int, dtype: torch.dtype) -> int:
    """Random Llama weights written tensor by tensor (never the whole model in memory); returns bytes."""
    import transformers

    from megappo.convert.hf_io import ShardedSafetensorsWriter
    from megappo.convert.mapping import model_spec_from_hf_config, param_maps

    heads = hidden // 128
    cfg = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=int(hidden * 2.6875) // 64 * 64, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), vocab_size=vocab,
        max_position_embeddings=4096, tie_word_embeddings=False,
    )
    cfg.dtype = str(dtype).replace("torch.", "")
    os.makedirs(path, exist_ok=True)
    cfg.save_pretrained(path)
    spec = model_spec_from_hf_config(json.loads(cfg.to_json_string()))
    ffn, kv = cfg.intermediate_size, cfg.num_key_value_heads * (hidden // heads)
    shapes = {"q_proj": (hidden, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, hidden),
              "gate_proj": (ffn, hidden), "up_proj": (ffn, hidden), "down_proj": (hidden, ffn)}
    writer = ShardedSafetensorsWriter(path, max_shard_bytes=1 << 30)
    gen = torch.Generator().manual_seed(0)
    for pm in param_maps(spec):
        for name in pm.hf:
            if "norm" in name:
                shape = (hidden,)
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                shape = (vocab, hidden)
            else:
                shape = shapes[name.split(".")[-2]]
            writer.add(name, (torch.randn(shape, generator=gen) * 0.02).to(dtype))
    writer.close()
    return writer.total_bytes


def _pss(p) -> int:
    try:
        return p.memory_full_info().pss
    except (AttributeError, OSError):
        return p.memory_info().rss


def run_measured(cmd: list[str]) -> tuple[float, float, str]:
    """Run `cmd`; return (seconds, peak resident memory (PSS) of its process tree in GB, output)."""
    import psutil

    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = 0
    root = psutil.Process(proc.pid)
    out_chunks: list[str] = []
    import threading

    reader = threading.Thread(target=lambda: out_chunks.append(proc.stdout.read()), daemon=True)
    reader.start()
    while proc.poll() is None:
        try:
            procs = [root] + root.children(recursive=True)
            # PSS: pages shared by forked workers (dist_checkpointing's writers) are counted once, not per process
            peak = max(peak, sum(_pss(p) for p in procs))
        except psutil.Error:
            pass
        time.sleep(0.1)
    reader.join()
    seconds = time.time() - t0
    output = "".join(out_chunks)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{output[-4000:]}")
    return seconds, peak / 1e9, output


def same_tensors(a: str, b: str) -> int:
    """Compare every tensor of two HF dirs one at a time; return the count (raises on a difference)."""
    from megappo.convert.hf_io import HFCheckpoint

    ca, cb = HFCheckpoint.open(a), HFCheckpoint.open(b)
    if set(ca.files) != set(cb.files):
        raise AssertionError(f"tensor names differ: {sorted(set(ca.files) ^ set(cb.files))[:5]}")
    for name in ca.files:
        if not torch.equal(ca.read(name), cb.read(name)):
            raise AssertionError(f"{name} differs")
    return len(ca.files)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--workdir", default=None, help="default: a new directory under $TMPDIR")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    args = p.parse_args()
    torch.set_num_threads(1)
    from megappo.platform import parse_dtype

    work = args.workdir or tempfile.mkdtemp(prefix="megappo_bench_convert_")
    src, mc, out = (os.path.join(work, n) for n in ("hf", "mcore", "hf_out"))
    env_cmd = [sys.executable, "-m", "megappo.cli", "convert"]
    try:
        t0 = time.time()
        nbytes = make_checkpoint(src, args.layers, args.hidden, args.vocab, parse_dtype(args.dtype))
        print(f"model: llama {args.layers} layers hidden {args.hidden} vocab {args.vocab} {args.dtype}: "
              f"{nbytes / 1e9:.2f} GB written in {time.time() - t0:.1f} s", flush=True)
        steps = [("hf-to-mcore", env_cmd + ["hf-to-mcore", "--hf", src, "--out", mc + "_128MB", "--bucket-size", "128MB"]),
                 ("hf-to-mcore", env_cmd + ["hf-to-mcore", "--hf", src, "--out", mc]),
                 ("mcore-to-hf", env_cmd + ["mcore-to-hf", "--mcore", mc, "--out", out]),
                 ("mcore-to-hf", env_cmd + ["mcore-to-hf", "--mcore", mc, "--out", out + "_model", "--from-model"])]
        for step, cmd in steps:
            seconds, peak, output = run_measured(cmd)
            line = next((ln for ln in output.splitlines()[::-1] if ln.startswith(f"{step}:")), "")
            if "--from-model" in cmd:
                step += " --from-model"
            if "--bucket-size" in cmd:
                step += " --bucket-size 128MB"
            else:
                step += " (default 512MB buckets)" if step == "hf-to-mcore" else ""
            print(f"{step}: {nbytes / 1e9:.2f} GB, process {seconds:.1f} s ({nbytes / 1e9 / seconds:.3f} GB/s incl. "
                  f"start-up), peak memory (PSS) {peak:.2f} GB ({peak * 1e9 / nbytes:.2f}x the model) | {line}", flush=True)
        t0 = time.time()
        n = same_tensors(src, out)
        same_tensors(src, out + "_model")
        print(f"round trip: {n} tensors bit-identical, both exports (checked in {time.time() - t0:.1f} s)")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
