#!/usr/bin/env python
"""Check that vLLM's own model class takes a Hugging Face checkpoint's tensors through its `load_weights`, the
function an engine-side weight update calls, so that each vLLM parameter equals the HF tensors it is built from.

What it does, in one process on CPU: builds vLLM's config for HF_DIR (EngineArgs(...).create_engine_config(),
float32, eager), starts a one-rank gloo process group and vLLM's model-parallel groups, constructs the model class
vLLM resolves for the checkpoint's architecture (vLLM's `initialize_model`, random init), then feeds it the
checkpoint's safetensors one tensor at a time, `model.load_weights([(hf_name, tensor)])`, recording which vLLM
parameters each HF name landed in. It then rebuilds each vLLM parameter from HF tensors through the model's
`packed_modules_mapping` (Qwen2: q/k/v stacked along dim 0 into qkv_proj, gate/up into gate_up_proj) and
compares. One HF name at a time is what a streamed sync does, and it shows which names vLLM dropped.

Prints one JSON object: vllm/torch versions, model class, `loaded` {hf_name: [vllm params]}, `not_taken` (HF
names that loaded into nothing), `max_abs_diff` {vllm param: float}, `unbuilt` (vLLM parameters no HF tensor maps
to), `ok`. Exits 1 unless every HF tensor was taken and every parameter equals its rebuild exactly.

Run it with the python of a vLLM venv (on a CPU-only machine: tools/vllm/install_cpu.sh):

    VENV/bin/python tools/vllm/check_loader.py HF_DIR [--port 29533]

With a CUDA `vllm` wheel installed --no-deps next to torch 2.13.0+cpu (vLLM 0.34.0 was checked so), add
--skip-triton-check: vLLM 0.34's CPU platform refuses x86 without triton-cpu when it builds the config.
"""
import argparse
import glob
import json
import os
import socket
import sys


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hf_tensors(hf_dir):
    from safetensors.torch import load_file

    out = {}
    for path in sorted(glob.glob(os.path.join(hf_dir, "*.safetensors"))):
        out.update(load_file(path))
    if not out:
        raise SystemExit(f"no *.safetensors in {hf_dir}")
    return out


def build_model(hf_dir, port):
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model

    # eager + no custom ops: the config a CPU engine runs with; TP=1 so every parameter is whole
    vllm_config = EngineArgs(model=hf_dir, dtype="float32", enforce_eager=True, max_model_len=128,
                             compilation_config={"custom_ops": ["none"]}).create_engine_config()
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
        initialize_model_parallel(1)
        with torch.device("cpu"):
            model = initialize_model(vllm_config)
    return vllm_config, model


def expected_param(name, hf, packed):
    """The HF tensor(s) a vLLM parameter is built from, stacked the way vLLM's merged layers stack them."""
    import torch

    if name in hf:
        return hf[name]
    for merged, parts in packed.items():
        token = f".{merged}."
        if token in name and all(name.replace(token, f".{p}.") in hf for p in parts):
            return torch.cat([hf[name.replace(token, f".{p}.")] for p in parts], dim=0)
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("hf_dir")
    ap.add_argument("--port", type=int, default=0, help="gloo rendezvous port (default: a free one)")
    ap.add_argument("--skip-triton-check", action="store_true",
                    help="let a CUDA vLLM wheel (>= 0.34) build its CPU config without triton-cpu; only the "
                         "config check raises, and nothing here runs a Triton kernel")
    args = ap.parse_args()
    hf_dir = os.path.abspath(args.hf_dir)
    # vLLM logs to stdout by default; stdout carries only the JSON answer
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

    import torch

    if not torch.cuda.is_available():
        # a CUDA vLLM wheel on a CPU-only machine detects no platform at all unless told
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import vllm

    if args.skip_triton_check:
        import vllm.triton_utils

        vllm.triton_utils.HAS_TRITON = True
    hf = hf_tensors(hf_dir)
    vllm_config, model = build_model(hf_dir, args.port or free_port())
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    params = dict(model.named_parameters())
    with torch.no_grad():
        # random init first, so a parameter load_weights never wrote cannot match the checkpoint by chance
        for p in params.values():
            p.normal_()
        loaded = {name: sorted(model.load_weights([(name, t)]) or []) for name, t in hf.items()}

    diffs, unbuilt = {}, []
    for name, p in params.items():
        exp = expected_param(name, hf, packed)
        if exp is None:
            unbuilt.append(name)
            continue
        # vocab-parallel layers pad rows to a multiple of 64; the padding is not part of the checkpoint
        got = p.detach()[: exp.shape[0]] if p.shape != exp.shape and p.shape[1:] == exp.shape[1:] else p.detach()
        if got.shape == exp.shape:
            diffs[name] = (got.float() - exp.float()).abs().max().item()
        else:
            diffs[name] = f"shape {tuple(p.shape)} vs {tuple(exp.shape)}"
    not_taken = sorted(n for n, v in loaded.items() if not v)
    ok = not not_taken and not unbuilt and all(d == 0.0 for d in diffs.values())
    print(json.dumps({
        "vllm": vllm.__version__, "torch": torch.__version__, "model_class": type(model).__name__,
        "tie_word_embeddings": getattr(vllm_config.model_config.hf_config, "tie_word_embeddings", None),
        "packed_modules_mapping": packed, "loaded": loaded, "not_taken": not_taken,
        "max_abs_diff": diffs, "unbuilt": unbuilt, "ok": ok,
    }, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
