#!/usr/bin/env python
"""Probe: push a Hugging Face checkpoint's tensors into a running vLLM server over a gloo group, the CPU analog
of SGLang's update_weights_from_distributed, and check the server's greedy tokens before and after.

vLLM's own weight-transfer backends (nccl, ipc) are GPU-only, so the engine side here is a vLLM worker extension
(`--worker-extension-cls gloo_sync_probe.GlooWeightSync`, methods reached through the dev-mode `/collective_rpc`):
one joins a gloo group with the trainer, the other receives named tensors by broadcast and loads them with the
model runner's `reload_weights(weights_iterator=...)`. A bare `model.load_weights` on a live CPU engine fails
("Attempted to load weight (torch.Size([128, 128])) into parameter (torch.Size([0]))"): after loading, the CPU
platform repacks linear weights and leaves the originals empty; reload_weights restores the checkpoint layout,
loads and re-processes.

Start the server (from the repo root, with the python of tools/vllm/install_cpu.sh's venv):

    PYTHONPATH=tools/vllm VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 VENV/bin/python \
      -m vllm.entrypoints.openai.api_server --model HF_A --served-model-name tiny --dtype float32 \
      --enforce-eager --max-model-len 256 --gpu-memory-utilization 0.1 --generation-config vllm \
      --worker-extension-cls gloo_sync_probe.GlooWeightSync --port 30412
    VENV/bin/python tools/vllm/gloo_sync_probe.py http://127.0.0.1:30412 HF_B [--port 29616]

It prints the greedy ids before, the sync time, and the greedy ids after (which should be HF_B's).
"""
import argparse
import json
import threading
import time
import urllib.request

import torch


class GlooWeightSync:
    """Mixed into vLLM's worker class; `self` is the worker."""

    def megappo_init_group(self, host, port, rank, world_size):
        store = torch.distributed.TCPStore(host, int(port), int(world_size), False)
        self._megappo_pg = torch.distributed.ProcessGroupGloo(store, int(rank), int(world_size))
        return "ok"

    def megappo_receive(self, spec_json):
        got = []
        for name, dtype, shape in json.loads(spec_json):
            t = torch.empty(shape, dtype=getattr(torch, dtype))
            self._megappo_pg.broadcast(t, 0).wait()
            got.append((name, t))
        self.model_runner.reload_weights(weights_iterator=iter(got))
        return len(got)


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=300).read() or b"null")


def in_thread(fn):
    """The server answers /collective_rpc only once the collective on its side is done: call it beside ours."""
    box = {}
    th = threading.Thread(target=lambda: box.update(out=fn()))
    th.start()
    return th, box


def greedy(url, ids, n=8):
    out = post(url + "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": n, "temperature": 0,
                                         "ignore_eos": True, "return_token_ids": True})
    return out["choices"][0]["token_ids"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url")
    ap.add_argument("hf_dir")
    ap.add_argument("--port", type=int, default=29616, help="gloo store port (trainer side hosts it)")
    args = ap.parse_args()
    from safetensors.torch import load_file

    prompt = [5, 6, 7, 8, 9]
    print("before", greedy(args.url, prompt), flush=True)
    # the trainer hosts the store; not waiting for workers lets the server's join run in the thread below
    store = torch.distributed.TCPStore("127.0.0.1", args.port, 2, True, wait_for_workers=False)
    th, box = in_thread(lambda: post(args.url + "/collective_rpc", {
        "method": "megappo_init_group", "args": ["127.0.0.1", str(args.port), "1", "2"]}))
    pg = torch.distributed.ProcessGroupGloo(store, 0, 2)
    th.join()
    tensors = load_file(f"{args.hf_dir}/model.safetensors")
    spec = [[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in tensors.items()]
    t0 = time.time()
    th, box = in_thread(lambda: post(args.url + "/collective_rpc", {"method": "megappo_receive",
                                                                     "args": [json.dumps(spec)]}))
    for t in tensors.values():
        pg.broadcast(t.contiguous(), 0).wait()
    th.join()
    print(f"synced {box['out']['results']} tensors in {time.time() - t0:.2f}s", flush=True)
    post(args.url + "/reset_prefix_cache", {})
    print("after", greedy(args.url, prompt), flush=True)


if __name__ == "__main__":
    main()
