"""Reading and writing Hugging Face checkpoint directories: validated safetensors shards, sliced reads, atomic
sharded writes, and the side files (config, tokenizer, generation config) a run needs.

Reads go through `safe_open(...).get_slice`, so a rank reads only the rows/columns of its shard (the file is
memory-mapped; untouched pages are never read). Every shard's header is checked against its size first, so a
truncated file fails up front with the file's name instead of a SIGBUS or a short read mid-conversion.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import struct
import uuid
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional

import torch

from megappo.convert.mapping import ConversionError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# written into every HF directory megappo exports: with `--force` a conversion replaces only directories holding it
# (or megatron's megappo_checkpoint.json), never a directory someone else's files live in
EXPORT_MARKER = "megappo_export.json"
CHECKPOINT_MARKER = "megappo_checkpoint.json"  # = megappo.models.checkpoint.MARKER_FILE (no megatron import here)
# Files copied next to a converted checkpoint so that a run (or transformers/SGLang) can start from it, and load it
# as the base was loaded: tokenizer, chat template, and a vision-language model's processor (AutoProcessor).
SIDE_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "chat_template.jinja",
    "chat_template.json", "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
)
SIDE_PATTERNS = ("*.tiktoken",)  # tokenizers stored under their own names (Qwen-1's qwen.tiktoken)
SIDE_DIRS = ("additional_chat_templates",)  # transformers' named chat templates beside the default one
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_safetensors_header(path: str) -> dict[str, dict]:
    """The tensor entries ({name: {dtype, shape, data_offsets}}) of a safetensors file, checked against its size.

    Raises ConversionError naming the file (and the first tensor past the end) for a truncated or corrupt file.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ConversionError(f"{path}: not a safetensors file ({size} bytes); re-download or re-save it")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise ConversionError(f"{path}: header says {n} bytes but the file has {size}; the file is truncated")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConversionError(f"{path}: unreadable safetensors header ({e}); the file is corrupt") from None
    header.pop("__metadata__", None)
    data = size - 8 - n
    for name, entry in header.items():
        end = entry["data_offsets"][1]
        if end > data:
            raise ConversionError(
                f"{path}: tensor {name!r} ends at byte {end} of the data section but the file holds {data}; the file "
                f"is truncated (re-download or re-save it)"
            )
    return header


@dataclass
class HFCheckpoint:
    """A validated HF model directory: config, and where each tensor lives.

    `read(name, dim, start, stop)` returns rows (dim 0) / columns (dim 1) [start, stop) of a tensor, or all of it
    (dim None), without loading the rest of its file.
    """

    path: str
    config: dict
    files: dict[str, str] = field(default_factory=dict)  # tensor name -> shard file name
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)

    @classmethod
    def open(cls, path: str) -> "HFCheckpoint":
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isdir(path):
            raise ConversionError(f"{path}: no such directory; pass a Hugging Face model directory")
        if not os.path.exists(cfg_path):
            raise ConversionError(f"{cfg_path}: missing; a Hugging Face model directory needs its config.json")
        ckpt = cls(path=path, config=read_json_object(cfg_path, "the model's config.json"))
        index = os.path.join(path, INDEX_FILE)
        if os.path.exists(index):
            weight_map = _weight_map(index)
            shard_files = sorted(set(weight_map.values()))
        elif os.path.exists(os.path.join(path, SINGLE_FILE)):
            weight_map, shard_files = {}, [SINGLE_FILE]
        else:
            raise ConversionError(
                f"{path}: neither {INDEX_FILE} nor {SINGLE_FILE}; megappo reads safetensors checkpoints only "
                f"(convert .bin files with transformers' save_pretrained(safe_serialization=True))"
            )
        for name in shard_files:
            fpath = os.path.join(path, name)
            if not os.path.exists(fpath):
                missing = sorted(k for k, v in weight_map.items() if v == name)
                raise ConversionError(
                    f"{index}: names shard {name!r}, which is missing ({len(missing)} tensors, e.g. {missing[:2]}); "
                    f"re-download the checkpoint"
                )
            for tensor, entry in read_safetensors_header(fpath).items():
                ckpt.files[tensor] = name
                ckpt.shapes[tensor] = tuple(entry["shape"])
                ckpt.dtypes[tensor] = _ST_DTYPES.get(entry["dtype"], torch.float32)
        for tensor, name in weight_map.items():
            if ckpt.files.get(tensor) != name:
                raise ConversionError(f"{index}: tensor {tensor!r} is mapped to {name!r} but that file lacks it")
        return ckpt

    def _open(self, file: str):
        from safetensors import safe_open

        return safe_open(os.path.join(self.path, file), framework="pt")

    def require(self, name: str, what: str) -> None:
        if name not in self.files:
            raise ConversionError(f"{self.path}: tensor {name!r} (for {what}) is missing from the checkpoint")

    def read(self, name: str, dim: Optional[int] = None, start: int = 0, stop: int = 0) -> torch.Tensor:
        self.require(name, "a megatron parameter")
        shape = self.shapes[name]
        if dim is not None and (dim >= len(shape) or stop > shape[dim]):
            raise ConversionError(
                f"{os.path.join(self.path, self.files[name])}: tensor {name!r} has shape {shape}; cannot take "
                f"[{start}:{stop}] of dim {dim} - the checkpoint does not match its config.json"
            )
        # One mapping per read: the file's pages are unmapped as soon as the slice is copied out, so the process
        # never accumulates the checkpoint's page cache in its resident set (measured: +1x the model otherwise).
        with self._open(self.files[name]) as f:
            sl = f.get_slice(name)
            if dim is None:
                return sl[:]
            return sl[start:stop] if dim == 0 else sl[:, start:stop]

    def close(self) -> None:
        """Nothing stays open between reads; kept so callers can release a checkpoint explicitly."""


def read_json_object(path: str, what: str) -> dict:
    """The JSON object in `path`; ConversionError naming the file (and `what` it should be) when it is unreadable,
    not JSON, or not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"{path}: not valid JSON ({e}); it should be {what}: restore it from the original "
                              f"model (re-download or re-export)") from None
    except OSError as e:
        raise ConversionError(f"{path}: cannot be read ({e.strerror}); it should be {what}") from None
    if not isinstance(value, dict):
        raise ConversionError(f"{path}: holds a JSON {type(value).__name__}, not an object; it should be {what}: "
                              f"restore it from the original model")
    return value


def _weight_map(index: str) -> dict[str, str]:
    weight_map = read_json_object(index, "a safetensors index").get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ConversionError(
            f"{index}: has no \"weight_map\" object (tensor name -> shard file); restore the index from the original "
            f"model, or delete it when the directory holds a single {SINGLE_FILE}"
        )
    return weight_map


def _real(path: str) -> str:
    return os.path.realpath(os.path.abspath(path))


def _inside(path: str, parent: str) -> bool:
    return path != parent and os.path.commonpath([path, parent]) == parent


def already_exists(path: str, more: str = "") -> ConversionError:
    return ConversionError(f"{path}: already exists; pass --force to overwrite it{more}")


def check_output_dir(out: str, inputs: dict[str, str], force: bool, out_flag: str = "--out") -> str:
    """Refuse an output that would destroy an input or someone else's files; return its absolute path.

    inputs: {flag: path} of what the conversion reads. Refused (ConversionError): an output that is, contains or
    lies inside an input (symlinks resolved); an existing output without `force`; with `force`, an existing output
    that megappo did not write (no `megappo_checkpoint.json` / `megappo_export.json`), unless it is empty.
    """
    real_out = _real(out)
    for flag, path in inputs.items():
        real_in = _real(path)
        if real_out == real_in:
            how = "is"
        elif _inside(real_in, real_out):
            how = "contains"
        elif _inside(real_out, real_in):
            how = "lies inside"
        else:
            continue
        raise ConversionError(
            f"{out_flag} {out} {how} the input {flag} {path} ({real_in}); writing there would "
            f"{'destroy' if how != 'lies inside' else 'write into'} the input: choose an {out_flag} outside it"
        )
    if not os.path.lexists(out):
        return os.path.abspath(out)
    if not force:
        raise already_exists(os.path.abspath(out), " (only a directory megappo wrote, or an empty one, is "
                                                   "overwritten)")
    if not os.path.isdir(out) or os.path.islink(out):
        raise ConversionError(f"{os.path.abspath(out)}: exists and is not a directory; --force replaces only a "
                              f"directory megappo wrote: remove it yourself or choose another {out_flag}")
    if os.listdir(out) and not any(os.path.isfile(os.path.join(out, m)) for m in (CHECKPOINT_MARKER, EXPORT_MARKER)):
        raise ConversionError(
            f"{os.path.abspath(out)}: exists and was not written by megappo (it holds neither {CHECKPOINT_MARKER} nor "
            f"{EXPORT_MARKER}); --force replaces only megappo's outputs and empty directories, so nothing was "
            f"deleted: remove it yourself or choose another {out_flag}"
        )
    return os.path.abspath(out)


def unique_staging_dir(out: str) -> str:
    """`<out>.tmp-<random>`: next to `out` (one rename publishes it), never shared by two conversions."""
    return f"{os.path.abspath(out)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}"


# what torch's zip writer (torch.save inside torch.distributed.checkpoint) raises instead of the OSError underneath
_TORCH_WRITE_FAILURES = ("PytorchStreamWriter", "inline_container", "file write failed")


def write_error(e: BaseException, out: str) -> Optional[ConversionError]:
    """A ConversionError naming the file and the fix when `e` is (or wraps, as torch's checkpoint writer does) an
    OSError: writing `out` (or its staging folder), or reading another file; None otherwise."""
    if isinstance(e, ConversionError):
        return None  # already says what failed
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError):
            where = f" ({x.filename})" if x.filename else ""
            if x.filename and not os.path.abspath(str(x.filename)).startswith(os.path.abspath(out)):
                return ConversionError(f"{x.filename}: {x.strerror or x}; check that it is readable (nothing was "
                                       f"published to {out})")
            return ConversionError(
                f"writing {out} failed: {x.strerror or x}{where}; nothing was published (the partial output was "
                f"removed): free space on its filesystem, check it is writable, or choose another --out"
            )
        if isinstance(x, RuntimeError) and any(m in str(x) for m in _TORCH_WRITE_FAILURES):
            return ConversionError(
                f"writing {out} failed: torch's file writer stopped ({str(x).strip().splitlines()[0][:160]}); nothing "
                f"was published (the partial output was removed): free space on its filesystem, check its file-size "
                f"limit (ulimit -f) and that it is writable, or choose another --out"
            )
        failures = getattr(x, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):  # rank -> (exception, traceback summary)
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [x.__cause__, None if x.__suppress_context__ else x.__context__]
    return None


def copy_side_files(src: str, dst: str, config: Optional[dict] = None) -> list[str]:
    """Copy config/tokenizer/generation-config files from `src` to `dst`; `config` replaces config.json."""
    names = list(SIDE_FILES) + sorted({os.path.basename(p) for pattern in SIDE_PATTERNS
                                        for p in glob.glob(os.path.join(src, pattern))})
    if _remote_code(src):  # config.json's auto_map names classes in the model's own .py files
        names += sorted(os.path.basename(p) for p in glob.glob(os.path.join(src, "*.py")))
    copied = []
    for name in names:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), os.path.join(dst, name))
            copied.append(name)
    for name in SIDE_DIRS:
        if os.path.isdir(os.path.join(src, name)):
            shutil.copytree(os.path.join(src, name), os.path.join(dst, name), dirs_exist_ok=True)
            copied.append(name)
    if config is not None:
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
    return copied


def _remote_code(model_dir: str) -> bool:
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            return bool(json.load(f).get("auto_map"))
    except (OSError, ValueError, AttributeError):
        return False


class StagingDir:
    """`with StagingDir(out, force) as tmp:` write into `tmp`; on success it replaces `out`, on error it is removed.

    An existing `out` is refused unless `force`; it is only removed once the new output is complete.
    """

    def __init__(self, out: str, force: bool = False):
        self.out = os.path.abspath(out)
        if os.path.exists(self.out) and not force:
            raise already_exists(self.out)
        self.tmp = unique_staging_dir(self.out)

    def __enter__(self) -> str:
        os.makedirs(os.path.dirname(self.out) or ".", exist_ok=True)
        os.makedirs(self.tmp)
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        try:
            replace_dir(self.tmp, self.out)
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise


def replace_dir(src: str, dst: str) -> None:
    """Rename the complete directory `src` to `dst`; an existing `dst` is removed only after the rename."""
    if os.path.exists(dst):
        old = f"{src}.old"
        os.rename(dst, old)
        os.rename(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(src, dst)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_TORCH_TO_ST = {v: k for k, v in _ST_DTYPES.items()}
HEADER_RESERVE = 1 << 20  # bytes reserved for a shard's JSON header: room for ~8000 tensor entries


class ShardedSafetensorsWriter:
    """Stream (name, tensor) pairs into safetensors shards of at most `max_shard_bytes`, then write the index.

    True streaming: each tensor is written to disk as it arrives and dropped, so peak memory is one tensor (plus
    whatever the caller holds). The header is not known until a shard ends, so `HEADER_RESERVE` bytes are reserved
    at the front and the final header is written there, padded with spaces as the safetensors format allows.
    Files get their final names model-0000i-of-0000N.safetensors on `close()`, which also writes
    model.safetensors.index.json.
    """

    def __init__(self, out_dir: str, max_shard_bytes: int, metadata: Optional[dict[str, str]] = None):
        self.out_dir, self.max_shard_bytes = out_dir, max_shard_bytes
        self.metadata = {"format": "pt", **(metadata or {})}
        self._file = None
        self._entries: dict[str, dict] = {}
        self._offset = 0  # bytes of tensor data in the open shard
        self._shards: list[tuple[str, list[str]]] = []  # temp file name, tensor names
        self._seen: set[str] = set()
        self.total_bytes = 0
        self.num_tensors = 0

    def _header_bytes(self) -> bytes:
        return json.dumps({"__metadata__": self.metadata, **self._entries}, separators=(",", ":")).encode()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._seen:
            raise ConversionError(f"tensor {name!r} written twice; the parameter mapping is inconsistent")
        self._seen.add(name)
        t = tensor.detach().to("cpu").contiguous()
        n = _nbytes(t)
        # ~100 bytes per header entry: start a new shard before the reserve could overflow
        if self._file is not None and (self._offset + n > self.max_shard_bytes or
                                       len(self._header_bytes()) + 200 + len(name) > HEADER_RESERVE):
            self._finish_shard()
        if self._file is None:
            tmp_name = f"shard-{len(self._shards):05d}.safetensors.partial"
            self._file = open(os.path.join(self.out_dir, tmp_name), "wb")
            self._file.write(b"\0" * (8 + HEADER_RESERVE))
            self._shards.append((tmp_name, []))
        if t.dtype not in _TORCH_TO_ST:
            raise ConversionError(f"tensor {name!r}: dtype {t.dtype} cannot be stored in safetensors")
        if n:
            self._file.write(t.view(-1).view(torch.uint8).numpy())  # buffer protocol: no extra copy
        self._entries[name] = {"dtype": _TORCH_TO_ST[t.dtype], "shape": list(t.shape),
                               "data_offsets": [self._offset, self._offset + n]}
        self._offset += n
        self._shards[-1][1].append(name)
        self.total_bytes += n
        self.num_tensors += 1

    def add_all(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in items:
            self.add(name, tensor)

    def _finish_shard(self) -> None:
        header = self._header_bytes()
        header += b" " * (HEADER_RESERVE - len(header))  # JSON may be followed by spaces
        self._file.seek(0)
        self._file.write(struct.pack("<Q", HEADER_RESERVE) + header)
        self._file.close()
        self._file, self._entries, self._offset = None, {}, 0

    def close(self) -> list[str]:
        """Finish the open shard, give shards their final names, write the index; return the file names."""
        if self._file is not None:
            self._finish_shard()
        n = len(self._shards)
        final = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map = {}
        for (tmp, names), name in zip(self._shards, final):
            os.rename(os.path.join(self.out_dir, tmp), os.path.join(self.out_dir, name))
            weight_map.update({t: name for t in names})
        # always an index, even for one shard: loaders (transformers, SGLang) take either, tools expect the index
        with open(os.path.join(self.out_dir, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))},
                      f, indent=2)
        return final

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def iter_items(buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> Iterator[tuple[str, torch.Tensor]]:
    for bucket in buckets:
        yield from bucket
