"""`megappo convert {hf-to-mcore, mcore-to-hf, verify}`: checkpoint conversion between Hugging Face and megatron.

Registration only builds argparse parsers (no torch/megatron import); handlers import lazily.

One process handles any model that fits in memory (tp = pp = ep = 1). For larger layouts launch every rank with
torchrun, e.g. `torchrun --nproc-per-node 4 -m megappo.cli convert hf-to-mcore --hf DIR --out DIR --tp 2 --pp 2`;
each rank then reads / holds only its shards.

Bad input exits with status 2 and one message naming the file or flag and the fix, checked in this order before
any rank starts work: flags (--dtype, sizes, layout sizes), paths (an output that is, contains or lies inside an
input is refused; --force replaces only a directory megappo wrote), whether the layout fits the model (naming
--tp/--pp/--ep), and only then whether the launch has enough ranks (the torchrun hint). When several ranks run, a
rank that fails prints its error and ends its process at once, so the ranks waiting for it in a collective fail
within seconds instead of hanging.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

_EPILOG = """\
multi-rank: torchrun --nproc-per-node N -m megappo.cli convert SUBCOMMAND ... --tp T --pp P --ep E
            (N = T*P*E with the default expert tensor parallel size T)
examples:
  megappo convert hf-to-mcore --hf Qwen2.5-0.5B --out ckpt/qwen-mcore
  megappo convert verify --hf Qwen2.5-0.5B --mcore ckpt/qwen-mcore
  megappo convert mcore-to-hf --mcore ckpt/step_100/actor --out export/actor-hf --dtype bf16
"""
_FORCE_HELP = ("replace an existing --out that megappo wrote, or an empty one, once the new output is complete "
               "(never an input, nor a directory holding other files)")


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
                    "dist_checkpoints, for llama, qwen2 (tied too), qwen3, qwen2_moe, qwen3_moe, mixtral and the "
                    "vision-language qwen2_5_vl and qwen2_vl; critic "
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
    h.add_argument("--force", action="store_true", help=_FORCE_HELP)
    h.add_argument("--bucket-size", default="512MB",
                   help="weights produced and written at a time per rank, e.g. 512MB, 2GB; peak memory is about one "
                        "bucket plus the largest tensor, not the model (default 512MB)")
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
    m.add_argument("--force", action="store_true", help=_FORCE_HELP)
    m.add_argument("--from-model", action="store_true",
                   help="build and load the megatron model (at --tp/--pp/--ep, torchrun for several ranks) and export "
                        "it through the trainer's weight-sync path, instead of streaming tensors out of the "
                        "checkpoint files (default; one process, memory ~ one parameter)")
    lg = m.add_mutually_exclusive_group()
    lg.add_argument("--merge-lora", action="store_true",
                    help="--mcore is a LoRA trainer checkpoint (global_step_N/actor, adapters only): write its base "
                         "model with the adapters merged (W + alpha/r * B A)")
    lg.add_argument("--lora-only", action="store_true",
                    help="--mcore is a LoRA trainer checkpoint: write a PEFT adapter directory (adapter_config.json, "
                         "adapter_model.safetensors) that peft loads onto the base model")
    m.add_argument("--base", default=None,
                   help="with --merge-lora/--lora-only: the base HF directory (default: the path the checkpoint "
                        "names; its checksum must match)")
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
    v.add_argument("--trust-remote-code", action="store_true",
                   help="let transformers run Python code shipped with the --hf model (its config's auto_map); off by "
                        "default: only transformers' own model classes load")
    _layout_args(v)
    v.set_defaults(func=_verify)


_FLAGS = {
    "convert.tensor_model_parallel_size": "--tp", "convert.pipeline_model_parallel_size": "--pp",
    "convert.virtual_pipeline_model_parallel_size": "--vpp", "convert.expert_model_parallel_size": "--ep",
    "convert.context_parallel_size": "context parallelism (not used by conversion)",
    "trainer.nnodes * trainer.n_gpus_per_node": "torchrun's --nnodes x --nproc-per-node",
}


def _needed_world(args) -> int:
    etp = args.etp or args.tp
    return args.tp * args.pp * max(1, -(-args.ep * etp // args.tp))


def _check_args(args) -> None:
    """Flags that need no file: dtype names, sizes, layout sizes, verify's numbers; then the paths."""
    from megappo.convert.hf_io import check_output_dir
    from megappo.convert.mapping import ConversionError
    from megappo.convert.mcore_to_hf import parse_size
    from megappo.platform import parse_dtype

    if getattr(args, "dtype", None) is not None:
        try:
            parse_dtype(args.dtype)
        except ValueError as e:
            raise ConversionError(f"--dtype {args.dtype!r}: {e}") from None
    for flag in ("bucket_size", "max_shard_size"):
        if getattr(args, flag, None) is not None:
            parse_size(getattr(args, flag), "--" + flag.replace("_", "-"))
    for flag in ("tp", "pp", "ep", "etp", "vpp", "batch", "seq_len"):
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            raise ConversionError(f"--{flag.replace('_', '-')} {value}: must be at least 1")
    if getattr(args, "atol", 0.0) < 0:
        raise ConversionError(f"--atol {args.atol}: must be >= 0")
    if args.convert_command == "hf-to-mcore":
        check_output_dir(args.out, {"--hf": args.hf}, args.force)
    elif args.convert_command == "mcore-to-hf":
        check_output_dir(args.out, {"--mcore": args.mcore}, args.force)
    elif args.convert_command == "verify":
        from megappo.convert.verify import require_local_hf_dir

        require_local_hf_dir(args.hf)


def _check_layout_fits(args) -> None:
    """LayoutError naming --tp/--pp/--ep when the layout cannot hold the model (heads, layers, experts), so that is
    said before the torchrun hint; a missing input is left to the conversion, which names it."""
    from megappo.convert.hf_io import read_json_object
    from megappo.kinds import kind_of
    from megappo.platform.layout import LayoutError, ParallelLayout, check_layout

    src = args.hf if args.convert_command == "hf-to-mcore" else args.mcore
    cfg_path = os.path.join(src, "config.json")
    if not os.path.isfile(cfg_path):
        return
    hf_cfg = read_json_object(cfg_path, "the model's Hugging Face config.json")
    spec = kind_of(hf_cfg).language_model_spec(hf_cfg, cfg_path)
    world = max(_needed_world(args), int(os.environ.get("WORLD_SIZE", "1")))
    try:
        check_layout(ParallelLayout(tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep, etp=args.etp), world,
                     num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                     num_layers=spec.num_layers, num_experts=spec.num_experts, prefix="convert")
    except LayoutError as e:
        msg = str(e)
        for key, flag in _FLAGS.items():
            msg = msg.replace(key, flag)
        raise LayoutError(f"{msg} ({cfg_path})") from None


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
    """Check the inputs, run `fn(args)`; a known error exits 2 with its message (no traceback).

    Several ranks (WORLD_SIZE > 1): a failing rank prints its error and leaves with os._exit, skipping every
    collective (teardown included) that would wait for ranks that are still working or failed too; its closed
    connections then fail the collectives the other ranks wait in, and they leave the same way.
    """
    from megappo.convert.mapping import ConversionError
    from megappo.models.checkpoint import CheckpointError
    from megappo.models.hf_config import UnsupportedModelError
    from megappo.parallel import lost_peer
    from megappo.platform.layout import LayoutError

    multi = int(os.environ.get("WORLD_SIZE", "1")) > 1
    try:
        _check_args(args)
        _check_layout_fits(args)
        _prelude(args)
        rc = fn(args)
    except (ConversionError, CheckpointError, UnsupportedModelError, LayoutError) as e:
        return _fail(f"error: {e}", 2, multi)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        if multi and lost_peer(e):
            return _fail(f"error: another rank stopped while this one waited for it ({str(e).splitlines()[0][:200]}); "
                         f"that rank's error says why", 1, multi)
        if multi:
            traceback.print_exc()
            return _fail(f"error: {type(e).__name__}: {e}", 1, multi)
        _teardown()
        raise
    _teardown()
    return rc


def _fail(message: str, code: int, multi: bool) -> int:
    if multi:
        from megappo.parallel import leave_run

        leave_run(message, code)
    print(message, file=sys.stderr, flush=True)
    _teardown()
    return code


def _teardown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        from megappo.parallel import destroy_parallel

        destroy_parallel(destroy_process_group=True)


def _hf_to_mcore(args) -> int:
    def go(a) -> int:
        from megappo.convert.mcore_to_hf import parse_size
        from megappo.kinds.commands import hf_to_mcore

        hf_to_mcore(a.hf, a.out, tp=a.tp, pp=a.pp, ep=a.ep, etp=a.etp, vpp=a.vpp, dtype=a.dtype, role=a.role,
                    force=a.force, bucket_bytes=parse_size(a.bucket_size, "--bucket-size"))
        return 0

    return _run(go, args)


def _mcore_to_hf(args) -> int:
    def go(a) -> int:
        from megappo.convert.mcore_to_hf import parse_size
        from megappo.kinds.commands import lora_to_hf, mcore_to_hf

        if a.merge_lora or a.lora_only:
            lora_to_hf(a.mcore, a.out, lora_only=a.lora_only, base=a.base, dtype=a.dtype, force=a.force, tp=a.tp,
                       pp=a.pp, ep=a.ep, max_shard_bytes=parse_size(a.max_shard_size, "--max-shard-size"))
            return 0
        mcore_to_hf(a.mcore, a.out, dtype=a.dtype, force=a.force, from_model=a.from_model, tp=a.tp, pp=a.pp, ep=a.ep,
                    etp=a.etp, max_shard_bytes=parse_size(a.max_shard_size, "--max-shard-size"))
        return 0

    return _run(go, args)


def _verify(args) -> int:
    def go(a) -> int:
        from megappo.kinds.commands import verify

        r = verify(a.hf, a.mcore, tp=a.tp, pp=a.pp, ep=a.ep, etp=a.etp, vpp=a.vpp, atol=a.atol, batch=a.batch,
                   seq_len=a.seq_len, dtype=a.dtype, trust_remote_code=a.trust_remote_code)
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_rank() == 0:
            what = "values" if r["role"] in ("critic", "reward") else "logits"
            print(f"verify: {r['role']} {what} {list(r['shape'])}: max |HF - megatron| = {r['max_abs_diff']:.3e} "
                  f"(atol {r['atol']:g}) -> {'OK' if r['ok'] else 'MISMATCH'}", flush=True)
        return 0 if r["ok"] else 1

    return _run(go, args)
