"""The `megappo convert` commands (`megappo.convert_cli` parses their flags): each works out the model's kind from
its config and hands the kind-independent work (reading, mapping, writing) to `megappo.convert`.

- `hf_to_mcore`: HF directory -> megatron dist_checkpoint, streamed a bucket at a time (`megappo.convert.hf_to_mcore`).
- `mcore_to_hf`: megatron dist_checkpoint -> HF directory (`megappo.convert.mcore_to_hf`).
- `verify`: the same tokens through the HF model and the converted checkpoint (`megappo.convert.verify`).
- `lora_to_hf`: a LoRA checkpoint merged into its base, or as a PEFT adapter directory (`megappo.convert.peft_io`).
"""
from __future__ import annotations

import os
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from megappo.convert.hf_io import HFCheckpoint, check_output_dir, read_json_object
from megappo.convert.hf_to_mcore import save_converted
from megappo.convert.mapping import ConversionError
from megappo.convert.mcore_to_hf import output_config, write_hf_dir
from megappo.convert.peft_io import read_lora_base, write_lora_export
from megappo.convert.verify import DEFAULT_ATOL, require_local_hf_dir
from megappo.kinds import kind_of
from megappo.kinds.build import build_for_conversion, build_model
from megappo.kinds.weights import iter_hf_weights, load_hf_weights


def hf_to_mcore(hf_dir: str, out_dir: str, *, tp: int = 1, pp: int = 1, ep: int = 1, etp: Optional[int] = None,
                vpp: Optional[int] = None, dtype: Optional[str] = None, role: str = "actor", force: bool = False,
                progress: bool = True, bucket_bytes: int = 512 << 20) -> dict[str, Any]:
    """Convert `hf_dir` into a megatron dist_checkpoint at `out_dir` on the ranks of the current launch.

    Run in one process for tp*pp*ep == 1, else under torchrun with tp*pp*(dp) ranks. Memory per rank stays near
    `bucket_bytes` plus the largest tensor: the model is built on the meta device and written a bucket at a time
    (`megappo.convert.stream_save`). Returns a summary dict.
    """
    from megappo.platform.layout import ParallelLayout
    from megappo.parallel import init_parallel
    from megappo.platform import detect_platform

    t0 = time.time()
    out = check_output_dir(out_dir, {"--hf": hf_dir}, force)  # before anything is read or built
    ckpt = HFCheckpoint.open(hf_dir)  # validates config, index and every shard before any rank builds anything
    kind = kind_of(ckpt.config)
    spec = kind.language_model_spec(ckpt.config, os.path.join(hf_dir, "config.json"))  # sizes init_parallel checks
    if role == "reward" and "score.weight" not in ckpt.files:
        raise ConversionError(f"{hf_dir}: --role reward needs a sequence-classification checkpoint (score.weight)")
    platform = detect_platform(dtype=dtype or _checkpoint_dtype(ckpt))
    layout = ParallelLayout(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp)
    ps = init_parallel(layout, platform, seed=0, num_attention_heads=spec.num_heads,
                       num_key_value_heads=spec.num_kv_heads, num_layers=spec.num_layers,
                       num_experts=spec.num_experts or None)
    # Built on the meta device: no weight exists until its bucket is written (see stream_save); megatron's random
    # init is skipped. The critic's fresh value head is real (ValueHead initialises it on the CPU).
    with torch.device("meta"):
        chunks = build_for_conversion(hf_dir, role, ps, platform)
    meta = dict(role=role, source=os.path.abspath(hf_dir), dtype=str(platform.dtype).replace("torch.", ""),
                layout=dict(tp=tp, pp=pp, ep=ep, etp=etp, vpp=vpp), family=ckpt.config["model_type"])
    t_save = time.time()
    stats = save_converted(chunks, kind.materialiser, ckpt, ps, role, out, bucket_bytes, progress, meta)
    ckpt.close()
    total = torch.tensor([stats["bytes"]], dtype=torch.float64, device=platform.device)  # NCCL: on the GPU
    if dist.get_world_size() > 1:
        dist.all_reduce(total)
    seconds = time.time() - t0
    summary = dict(tensors=stats["tensors"], bytes=int(total.item()), seconds=seconds, buckets=stats["buckets"],
                   save_seconds=time.time() - t_save, out=out)
    if ps.rank == 0 and progress:
        print(f"hf-to-mcore: {stats['tensors']} tensors on rank 0, {summary['bytes'] / 1e9:.3f} GB over all ranks "
              f"(tp{tp} pp{pp} ep{ep}) in {seconds:.1f} s ({summary['bytes'] / 1e9 / max(seconds, 1e-9):.3f} GB/s; "
              f"{stats['buckets']} buckets) -> {out}", flush=True)
    return summary


def mcore_to_hf(mcore_dir: str, out_dir: str, *, dtype: Optional[str] = None, force: bool = False,
                from_model: bool = False, tp: int = 1, pp: int = 1, ep: int = 1, etp: Optional[int] = None,
                max_shard_bytes: int = 5 * 10**9, bucket_bytes: int = 256 << 20,
                progress: bool = True) -> dict[str, Any]:
    """Write a complete HF directory for the megatron checkpoint `mcore_dir`.

    Default: streamed out of the checkpoint files one parameter at a time (`dist_reader`), in this process, no model
    built. from_model=True: build the model at tp/pp/ep (collective over the launch's ranks), load it and export
    it with `iter_hf_weights`, the trainer's weight-sync path. dtype: of the written tensors (default: the
    checkpoint's). Returns {tensors, bytes, seconds, out} (on rank 0).
    """
    from megappo.convert.dist_reader import checkpoint_dtype
    from megappo.models.checkpoint import verify_checkpoint
    from megappo.platform import parse_dtype

    t0 = time.time()
    check_output_dir(out_dir, {"--mcore": mcore_dir}, force)  # before any loading; StagingDir checks again
    info = verify_checkpoint(mcore_dir)  # names a missing or truncated file (or foreign code) before any read
    cfg_path = os.path.join(mcore_dir, "config.json")
    if not os.path.exists(cfg_path):
        raise ConversionError(f"{cfg_path}: missing; megappo writes the HF config next to the checkpoint "
                              f"(convert hf-to-mcore does); copy the model's config.json there")
    hf_config = read_json_object(cfg_path, "the model's Hugging Face config.json")
    role = info.get("role") or "actor"
    kind = kind_of(hf_config)
    kind.language_model_spec(hf_config, cfg_path)  # an unsupported config is said before anything is read
    saved = checkpoint_dtype(mcore_dir) or torch.float32
    out_dtype = parse_dtype(dtype) if dtype else saved
    if from_model:
        items, rank0, t_load = _items_from_model(mcore_dir, hf_config, role, saved, out_dtype, tp, pp, ep, etp,
                                                 bucket_bytes)
    else:
        items = kind.iter_hf_weights_from_checkpoint(mcore_dir, hf_config, role, dtype=out_dtype)
        rank0, t_load = True, 0.0
    summary = write_hf_dir(items, mcore_dir, out_dir, rank0, force, max_shard_bytes, progress,
                           output_config(hf_config, role, out_dtype))
    summary.update(load_seconds=t_load, total_seconds=time.time() - t0)
    if rank0 and progress:
        print(f"mcore-to-hf: {summary['tensors']} tensors, {summary['bytes'] / 1e9:.3f} GB written in "
              f"{summary['seconds']:.1f} s ({summary['bytes'] / 1e9 / max(summary['seconds'], 1e-9):.3f} GB/s"
              + (f"; model load {t_load:.1f} s" if from_model else ", streamed from the checkpoint")
              + f") -> {summary['out']}", flush=True)
    if from_model and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    return summary


def _items_from_model(mcore_dir, hf_config, role, saved, out_dtype, tp, pp, ep, etp, bucket_bytes):
    """Build and load the model at the layout; return (iterator of (name, tensor), is rank 0, load seconds)."""
    from megappo.models.checkpoint import load_model_checkpoint
    from megappo.platform.layout import ParallelLayout
    from megappo.parallel import init_parallel
    from megappo.platform import detect_platform

    t0 = time.time()
    platform = detect_platform(dtype=saved)
    ps = init_parallel(ParallelLayout(tp=tp, pp=pp, ep=ep, etp=etp), platform)
    chunks = build_for_conversion(mcore_dir, role, ps, platform)
    load_model_checkpoint(chunks, mcore_dir)
    buckets = iter_hf_weights(chunks, ps, hf_config, bucket_bytes=bucket_bytes, dtype=out_dtype)
    return (item for bucket in buckets for item in bucket), ps.rank == 0, time.time() - t0


def verify(hf_dir: str, mcore_dir: str, *, tp: int = 1, pp: int = 1, ep: int = 1, etp: Optional[int] = None,
           vpp: Optional[int] = None, atol: float = DEFAULT_ATOL, batch: int = 2, seq_len: int = 16,
           dtype: str = "float32", seed: int = 0, trust_remote_code: bool = False) -> dict[str, Any]:
    """Build the megatron model at the given layout from `mcore_dir` and compare with `hf_dir` (a local directory).

    Collective (every rank of the launch). Returns {max_abs_diff, atol, ok, shape}; rank 0 ran the HF model.
    """
    from megappo.models.checkpoint import load_model_checkpoint, verify_checkpoint
    from megappo.platform.layout import ParallelLayout
    from megappo.parallel import init_parallel
    from megappo.platform import detect_platform, parse_dtype

    require_local_hf_dir(hf_dir)
    info = verify_checkpoint(mcore_dir)
    role = info.get("role") or "actor"
    mcfg = read_json_object(os.path.join(mcore_dir, "config.json"), "the model's Hugging Face config.json")
    platform = detect_platform(dtype=dtype)
    layout = ParallelLayout(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp)
    ps = init_parallel(layout, platform)
    chunks = build_for_conversion(mcore_dir, role, ps, platform)
    load_model_checkpoint(chunks, mcore_dir)
    return kind_of(mcfg).verify(hf_dir, chunks, ps, mcfg, atol=atol, dtype=parse_dtype(dtype), seed=seed,
                                batch=batch, seq_len=seq_len, trust_remote_code=trust_remote_code)


def lora_to_hf(ckpt_dir: str, out_dir: str, *, lora_only: bool = False, base: Optional[str] = None,
               dtype: Optional[str] = None, force: bool = False, tp: int = 1, pp: int = 1, ep: int = 1,
               max_shard_bytes: int = 5 * 10**9, progress: bool = True) -> str:
    """Export a LoRA checkpoint merged into its base (a complete HF directory) or as a PEFT adapter directory.
    base: the base HF directory (default: the one the checkpoint names, which must still have its checksum)."""
    from megappo.models.checkpoint import load_model_checkpoint
    from megappo.models.hf_config import load_hf_config_dict
    from megappo.models.lora import LoRASettings, apply_lora, base_checksum
    from megappo.parallel import init_parallel
    from megappo.platform import detect_platform, parse_dtype
    from megappo.platform.layout import ParallelLayout

    info = read_lora_base(ckpt_dir)
    base = os.path.abspath(base or info["path"])
    if base_checksum(base) != info["sha256"]:
        raise ConversionError(f"{base} is not the base model the adapters in {ckpt_dir} were trained on "
                              f"(sha256 differs from {info['sha256'][:12]}...); pass --base with that model")
    check_output_dir(out_dir, {"--mcore": ckpt_dir, "--base": base}, force)
    lora = info["lora"]
    hf_config = load_hf_config_dict(base)
    out_dtype = parse_dtype(dtype) if dtype else torch.float32
    platform = detect_platform(dtype=torch.float32)
    ps = init_parallel(ParallelLayout(tp=tp, pp=pp, ep=ep), platform)
    chunks = build_model(base, "actor", ps, platform, config_overrides={"use_transformer_engine": False})
    load_hf_weights(chunks, base, ps)
    # the adapters' shape as the checkpoint recorded it; their values come from the checkpoint, not an initialisation
    apply_lora(chunks, LoRASettings(rank=lora["rank"], alpha=lora["alpha"], dropout=0.0,
                                    target_modules=lora["target_modules"], exclude_modules=lora["exclude_modules"],
                                    a_init="xavier"))
    load_model_checkpoint(chunks, ckpt_dir)
    # a generator: the kind's export runs only if the merged model is what gets written
    merged = (item for bucket in iter_hf_weights(chunks, ps, hf_config, dtype=out_dtype) for item in bucket)
    write_lora_export(chunks, ps, hf_config, merged, lora, base, out_dir, lora_only=lora_only, dtype=out_dtype,
                      force=force, max_shard_bytes=max_shard_bytes, progress=progress)
    return out_dir


def _checkpoint_dtype(ckpt: HFCheckpoint) -> str:
    """The dtype of the checkpoint's weights (config's `torch_dtype`/`dtype`, else the first tensor's)."""
    name = ckpt.config.get("dtype") or ckpt.config.get("torch_dtype")
    if name:
        return str(name)
    first = next(iter(ckpt.dtypes.values()), torch.float32)
    return str(first).replace("torch.", "")
