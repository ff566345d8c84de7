"""MoE router replay: how many bytes the routes cost per token (in memory, on SGLang's wire, in a checkpoint's
samples) for real MoE shapes, and what recording them costs the in-process engine.

Routes of a token are L MoE layers x top-k expert ids. megappo keeps them as uint8 (up to 256 experts, else int16):
L * k bytes a token in `Completion.routed_experts` / `Samples.routed_experts` (prompt + response - 1 tokens a
sample) and in the padded `ModelBatch.routes` [B, T, L, k] (padding included); SGLang sends int32 in base64
(4 * L * k * 4/3); a checkpoint's samples (async queues' `TrainState.ready`) hold the uint8 bytes in base64 JSON.
The checkpoint figure is measured on a real `Samples.to_json` of random routes of each shape.

The engine figure: `HFEngine.generate` of a tiny Qwen3-MoE (random weights), with and without
`return_routed_experts`, best of `--repeats`.

    python tools/bench/bench_router_replay.py [--tokens 2048] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

# (name, MoE layers, top-k, experts) of public MoE models' configs
SHAPES = [
    ("tiny Qwen3-MoE (tests)", 4, 2, 4),
    ("Qwen3-30B-A3B", 48, 8, 128),
    ("Qwen3-235B-A22B", 94, 8, 128),
    ("DeepSeek-V3 (58 MoE of 61 layers)", 58, 8, 256),
    ("Qwen2-57B-A14B", 28, 8, 64),
    ("a 512-expert model (int16)", 48, 8, 512),
]


def _bytes_per_token(layers: int, topk: int, experts: int, tokens: int) -> dict[str, float]:
    from megappo.models.router_replay import routes_dtype
    from megappo.trainer.experience import Samples

    dtype = routes_dtype(experts)
    routes = torch.randint(0, experts, (tokens, layers, topk)).to(dtype)
    s = Samples([[1]], [[2]], [[-1.0]], [False], [0], ["d"], [None], [{}], [0], [0], [False], routed_experts=[routes])
    checkpoint = len(json.dumps(s.to_json()["routed_experts"]))
    return {"memory": routes.element_size() * layers * topk, "sglang_wire": 4 * layers * topk * 4 / 3,
            "checkpoint": checkpoint / tokens}


def _engine_cost(repeats: int) -> tuple[float, float]:
    from megappo.rollout import HFEngine, SamplingParams
    from megappo.testing.hf_models import make_hf_model

    d = make_hf_model("qwen3_moe", tempfile.mkdtemp())
    engine = HFEngine(d)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 400, (int(n),), generator=g).tolist() for n in torch.randint(8, 64, (16,))]
    times = {}
    for record in (False, True, False, True):
        params = SamplingParams(max_new_tokens=64, temperature=1.0, seed=1, ignore_eos=True,
                                return_routed_experts=record)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            engine.generate(prompts, params)
            best = min(best, time.perf_counter() - t0)
        times[record] = min(times.get(record, best), best)
    return times[False], times[True]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of the sample measured for the checkpoint")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'model':36s} {'L x k':>7s} {'memory B/tok':>13s} {'SGLang wire':>12s} {'checkpoint':>11s}")
    for name, layers, topk, experts in SHAPES:
        b = _bytes_per_token(layers, topk, experts, args.tokens)
        print(f"{name:36s} {layers:>3d} x {topk:<2d} {b['memory']:>13.0f} {b['sglang_wire']:>12.0f} "
              f"{b['checkpoint']:>11.1f}")
    off, on = _engine_cost(args.repeats)
    print(f"in-process engine, 16 prompts x 64 tokens, tiny Qwen3-MoE: {off:.3f} s without recording, {on:.3f} s "
          f"with ({(on / off - 1) * 100:+.1f}%)")


if __name__ == "__main__":
    main()
