"""Megatron dist_checkpoint -> Hugging Face directory (`megappo convert mcore-to-hf`).

Two sources, one mapping (`mapping.merge_to_hf`) and one writer:
- default: `dist_reader` reads each parameter's slice of the checkpoint's global tensors and converts it; no model
  is built, so peak memory is about one parameter whatever the model size, in one process.
- `--from-model`: the model is built at a layout (torchrun for several ranks), loaded with
  `load_model_checkpoint` and walked with `export.iter_hf_weights`, the trainer's weight-sync path; the loaded
  model is resident (its size divided by the number of model-parallel ranks).
Rank 0 streams each tensor straight into safetensors shards (`ShardedSafetensorsWriter`) in a staging directory
that is renamed to the output when complete.
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from megappo.convert.hf_io import (
    EXPORT_MARKER, ShardedSafetensorsWriter, StagingDir, check_output_dir, copy_side_files, read_json_object,
    write_error,
)
from megappo.convert.mapping import ConversionError
from megappo.kinds import kind_of
from megappo.models.families import FAMILIES


def output_config(config: dict, role: str, dtype: torch.dtype) -> dict:
    """The config.json of the exported model: dtype updated; value models become `*ForSequenceClassification`
    with one label (their value head is `score.weight`)."""
    cfg = dict(config)
    name = str(dtype).replace("torch.", "")
    cfg["dtype"] = name
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = name
    if role in ("critic", "reward"):
        cfg["architectures"] = [FAMILIES[cfg["model_type"]].seq_cls]
        cfg["num_labels"] = 1
        cfg["id2label"], cfg["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    return cfg


def parse_size(text: str, flag: str = "size") -> int:
    """'5GB', '500MB', '1.5GiB', '1024' -> bytes; ConversionError naming `flag` for anything else (or <= 0)."""
    t = str(text).strip().upper()
    units = [("GIB", 1 << 30), ("MIB", 1 << 20), ("KIB", 1 << 10), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3),
             ("B", 1)]
    mult = next((m for suffix, m in units if t.endswith(suffix)), 1)
    number = next((t[: -len(suffix)] for suffix, _ in units if t.endswith(suffix)), t)
    try:
        value = float(number) * mult
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value < 1:
        raise ConversionError(f"{flag} {text!r}: not a positive size; give a number of bytes with an optional unit, "
                              f"e.g. 512MB, 2GB, 1.5GiB")
    return int(value)


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
    from megappo.convert.export import iter_hf_weights
    from megappo.convert.hf_to_mcore import build_for_conversion
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


def write_hf_dir(items, side_files_from: str, out_dir: str, rank0: bool, force: bool, max_shard_bytes: int,
                 progress: bool, config: dict) -> dict[str, Any]:
    """Rank 0 streams `items` ((HF name, tensor) pairs) into a staging directory renamed to `out_dir` when complete,
    with `config` as config.json, the tokenizer/generation files of `side_files_from` and megappo's `EXPORT_MARKER`
    (which lets a later `--force` replace it); other ranks only drive the (collective) iterator. Also the trainer's
    final export of the actor. A write error (disk full, ...) raises ConversionError naming `out_dir`, and leaves
    no staging directory behind."""
    if not rank0:
        for _ in items:
            pass
        return {"out": os.path.abspath(out_dir)}
    t0 = time.time()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(desc="mcore-to-hf", unit=" tensors")
    try:
        with StagingDir(out_dir, force=force) as tmp:
            writer = ShardedSafetensorsWriter(tmp, max_shard_bytes)
            try:
                for name, tensor in items:
                    writer.add(name, tensor)
                    if bar is not None:
                        bar.update(1)
                writer.close()
            finally:
                writer.abort()
                if bar is not None:
                    bar.close()
            copy_side_files(side_files_from, tmp, config=config)
            with open(os.path.join(tmp, EXPORT_MARKER), "w") as f:
                json.dump({"written_by": "megappo", "source": os.path.abspath(side_files_from),
                           "written_at": time.time()}, f, indent=1)
    except BaseException as e:  # torch's CheckpointException is no Exception
        err = write_error(e, os.path.abspath(out_dir)) if not isinstance(e, KeyboardInterrupt) else None
        if err is not None:
            raise err from e
        raise
    return dict(out=os.path.abspath(out_dir), tensors=writer.num_tensors, bytes=writer.total_bytes,
                seconds=time.time() - t0)
