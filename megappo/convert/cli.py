"""`megappo convert {hf-to-mcore, mcore-to-hf, verify}`: checkpoint conversion between Hugging Face and megatron.

Registration only builds argparse parsers (no torch/megatron import); handlers import lazily.

One process handles any model that fits in memory (tp = pp = ep = 1). For larger layouts launch every rank with
torchrun, e.g. `torchrun --nproc-per-node 4 -m megappo.cli convert hf-to-mcore --hf DIR --out DIR --tp 2 --pp 2`;
each rank then reads / holds only its shards.
"""
from __future__ import annotations

import argparse
import os
import sys

_EPILOG = """\
multi-rank: torchrun --nproc-per-node N -m megappo.cli convert SUBCOMMAND ... --tp T --pp P --ep E
            (N = T*P*E with the default expert tensor parallel size T)
examples:
  megappo convert hf-to-mcore --hf Qwen2.5-0.5B --out ckpt/qwen-mcore
  megappo convert verify --hf Qwen2.5-0.5B --mcore ckpt/qwen-mcore
  megappo convert mcore-to-hf --mcore ckpt/step_100/actor --out export/actor-hf --dtype bf16
"""


def _layout_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallel layout (more than one rank: launch with torchrun)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    g.add_argument("--ep", type=int, default=1, help="expert-parallel size, MoE models (default 1)")
    g.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (default: --tp)")
    g.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per pipeline rank")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "convert", help="convert checkpoints between Hugging Face and megatron (and verify a conversion)",
        description="Checkpoint conversion between Hugging Face safetensors directories and megatron "
                    "dist_checkpoints, for llama, qwen2 (tied too), qwen3, qwen2_moe, qwen3_moe and mixtral; critic "
                    "and reward models (value head <-> score.weight) included.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="convert_command", metavar="SUBCOMMAND")
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])

    h = sub.add_parser(
        "hf-to-mcore", help="HF directory -> megatron dist_checkpoint (+ config and tokenizer files)",
        description="Stream a Hugging Face checkpoint into megatron at the given layout and save a dist_checkpoint "
                    "that loads at any layout. The HF config, generation config and tokenizer files are copied "
                    "alongside so a training run can start from the output directory.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    h.add_argument("--hf", required=True, help="Hugging Face model directory (config.json + safetensors)")
    h.add_argument("--out", required=True, help="output directory (must not exist unless --force)")
    h.add_argument("--dtype", default=None, help="parameter dtype: bf16, fp16, fp32 (default: the checkpoint's)")
    h.add_argument("--role", default="actor", choices=["actor", "ref", "critic", "reward"],
                   help="actor/ref: causal LM; critic: causal LM body + fresh value head; reward: sequence-"
                        "classification checkpoint, score.weight -> value head (default actor)")
    h.add_argument("--force", action="store_true", help="overwrite an existing --out (replaced once complete)")
    h.add_argument("--bucket-size", default="512MB",
                   help="weights produced and written at a time per rank, e.g. 512MB, 2GB; peak memory is about twice "
                        "this plus the largest tensor (default 512MB)")
    _layout_args(h)
    h.set_defaults(func=_hf_to_mcore)

    m = sub.add_parser(
        "mcore-to-hf", help="megatron dist_checkpoint -> complete HF directory",
        description="Write a Hugging Face directory (config.json, generation_config.json when present, tokenizer "
                    "files, safetensors shards with model.safetensors.index.json) that transformers and SGLang "
                    "load as is. Value models (critic/reward) are written as *ForSequenceClassification.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    m.add_argument("--mcore", required=True, help="megatron checkpoint directory written by megappo")
    m.add_argument("--out", required=True, help="output directory (must not exist unless --force)")
    m.add_argument("--dtype", default=None, help="dtype of the written tensors (default: the checkpoint's)")
    m.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB (default 5GB)")
    m.add_argument("--force", action="store_true", help="overwrite an existing --out (replaced once complete)")
    m.add_argument("--from-model", action="store_true",
                   help="build and load the megatron model (at --tp/--pp/--ep, torchrun for several ranks) and export "
                        "it through the trainer's weight-sync path, instead of streaming tensors out of the "
                        "checkpoint files (default; one process, memory ~ one parameter)")
    _layout_args(m)
    m.set_defaults(func=_mcore_to_hf)

    v = sub.add_parser(
        "verify", help="compare a megatron checkpoint's outputs with the HF model's",
        description="Build the HF model (transformers) and the megatron model (at the given layout), run the same "
                    "token batch through both and print the largest absolute difference of the logits (values for "
                    "critic/reward models). Exits 1 when it exceeds --atol.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    v.add_argument("--hf", required=True, help="Hugging Face model directory")
    v.add_argument("--mcore", required=True, help="megatron checkpoint directory")
    v.add_argument("--atol", type=float, default=1e-3, help="largest allowed absolute difference (default 1e-3)")
    v.add_argument("--dtype", default="float32", help="compute dtype of both models (default float32)")
    v.add_argument("--batch", type=int, default=2, help="sequences in the test batch (default 2)")
    v.add_argument("--seq-len", type=int, default=16, help="tokens per sequence (default 16)")
    _layout_args(v)
    v.set_defaults(func=_verify)


def _needed_world(args) -> int:
    etp = args.etp or args.tp
    return args.tp * args.pp * max(1, -(-args.ep * etp // args.tp))


def _prelude(args) -> None:
    """One torch thread per rank on CPU; a multi-rank layout without torchrun fails with the command to run."""
    need = _needed_world(args)
    if need > int(os.environ.get("WORLD_SIZE", "1")):
        raise SystemExit(
            f"error: --tp {args.tp} --pp {args.pp} --ep {args.ep} needs {need} ranks (or a multiple), this launch has "
            f"{os.environ.get('WORLD_SIZE', '1')}; launch with\n"
            f"  torchrun --nproc-per-node {need} -m megappo.cli convert {args.convert_command} <the same arguments>"
        )
    import torch

    if not torch.cuda.is_available():
        torch.set_num_threads(int(os.environ.get("MEGAPPO_CPU_THREADS", "1")))


def _run(fn, args) -> int:
    from megappo.convert.mapping import ConversionError
    from megappo.models.checkpoint import CheckpointError
    from megappo.models.hf_config import UnsupportedModelError
    from megappo.platform.layout import LayoutError

    try:
        return fn(args)
    except (ConversionError, CheckpointError, UnsupportedModelError, LayoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        _teardown()


def _teardown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        from megappo.parallel import destroy_parallel

        destroy_parallel(destroy_process_group=True)


def _hf_to_mcore(args) -> int:
    _prelude(args)
    from megappo.convert.hf_to_mcore import hf_to_mcore
    from megappo.convert.mcore_to_hf import parse_size

    return _run(lambda a: (hf_to_mcore(a.hf, a.out, tp=a.tp, pp=a.pp, ep=a.ep, etp=a.etp, vpp=a.vpp, dtype=a.dtype,
                                       role=a.role, force=a.force,
                                       bucket_bytes=parse_size(a.bucket_size)), 0)[1], args)


def _mcore_to_hf(args) -> int:
    _prelude(args)
    from megappo.convert.mcore_to_hf import mcore_to_hf, parse_size

    return _run(lambda a: (mcore_to_hf(a.mcore, a.out, dtype=a.dtype, force=a.force, from_model=a.from_model,
                                       tp=a.tp, pp=a.pp, ep=a.ep, etp=a.etp,
                                       max_shard_bytes=parse_size(a.max_shard_size)), 0)[1], args)


def _verify(args) -> int:
    _prelude(args)
    from megappo.convert.verify import verify

    def go(a) -> int:
        r = verify(a.hf, a.mcore, tp=a.tp, pp=a.pp, ep=a.ep, etp=a.etp, vpp=a.vpp, atol=a.atol, batch=a.batch,
                   seq_len=a.seq_len, dtype=a.dtype)
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_rank() == 0:
            what = "values" if r["role"] in ("critic", "reward") else "logits"
            print(f"verify: {r['role']} {what} {list(r['shape'])}: max |HF - megatron| = {r['max_abs_diff']:.3e} "
                  f"(atol {r['atol']:g}) -> {'OK' if r['ok'] else 'MISMATCH'}", flush=True)
        return 0 if r["ok"] else 1

    return _run(go, args)
