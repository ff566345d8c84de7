"""Megatron dist_checkpoint -> Hugging Face directory: the writer and config of `megappo convert mcore-to-hf`
(`megappo.kinds.commands.mcore_to_hf`, which asks the model's kind for the tensors).

Two sources, one mapping (`mapping.merge_to_hf`) and one writer:
- default: `dist_reader` reads each parameter's slice of the checkpoint's global tensors and converts it; no model
  is built, so peak memory is about one parameter whatever the model size, in one process.
- `--from-model`: the model is built at a layout (torchrun for several ranks), loaded with
  `load_model_checkpoint` and walked with `megappo.kinds.weights.iter_hf_weights`, the trainer's weight-sync path;
  the loaded model is resident (its size divided by the number of model-parallel ranks).
Rank 0 streams each tensor straight into safetensors shards (`ShardedSafetensorsWriter`) in a staging directory
that is renamed to the output when complete.
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import torch

from megappo.convert.hf_io import EXPORT_MARKER, ShardedSafetensorsWriter, StagingDir, copy_side_files, write_error
from megappo.convert.mapping import ConversionError
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
