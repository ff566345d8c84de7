"""Reading the pickled parts of a megatron dist_checkpoint without running code shipped in it.

A torch_dist checkpoint holds three kinds of pickle: `.metadata` (torch.distributed.checkpoint's `Metadata`, which
torch reads with a bare `pickle.load`), `common.pt` (megatron's common state, a `torch.save` archive) and byte items
inside the `.distcp` files (ShardedObjects such as `_extra_state`, which torch's load planner reads with
`torch.load(weights_only=False)`). Any of them can name an arbitrary global (`os.system`, ...) that runs the moment
it is unpickled, so a checkpoint from elsewhere is checked here before torch or megatron reads it:

- `.metadata` goes through `AllowListUnpickler`, whose `find_class` admits only the classes checkpoint metadata is
  made of (listed in `ALLOWED`, found by reading checkpoints megappo and megatron write) and refuses anything else
  before it is imported or called;
- the `torch.save` pickles (common state, byte items) are read with torch's own allow-list loader
  (`torch.load(weights_only=True)`), the loader megatron itself uses for `common.pt` by default.
"""
from __future__ import annotations

import io
import pickle
from typing import Any, BinaryIO, Union

import torch

# module -> names a dist_checkpoint's `.metadata` may reference (classes it is built from, nothing callable else)
ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "MetadataIndex", "StorageMeta", "ChunkStorageMetadata", "TensorProperties",
        "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING",
    }),
    "torch.distributed.checkpoint.planner": frozenset({
        "SavePlan", "LoadPlan", "WriteItem", "ReadItem", "WriteItemType", "LoadItemType", "TensorWriteData",
        "BytesIOWriteData",
    }),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo", "_StoragePrefix"}),
    # torch.layout objects pickle as _get_layout("torch.strided"): a lookup in a table of torch's layouts
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size", "device"}),  # and torch's dtype / layout / memory_format constants, see below
    "builtins": frozenset({"set", "frozenset", "slice", "range", "complex"}),
    "collections": frozenset({"OrderedDict"}),
    # StorageMeta.checkpoint_id is the save's path, a pathlib object when the writer was given one
    "pathlib": frozenset({"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}),
}
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)


class UnsafePickleError(pickle.UnpicklingError):
    """A pickle that references a global outside the allow-list (or is no pickle of the expected kind)."""


class AllowListUnpickler(pickle.Unpickler):
    """An Unpickler that resolves only `ALLOWED` globals (plus torch's dtype/layout/memory-format constants)."""

    def find_class(self, module: str, name: str) -> Any:
        if name in ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and "." not in name and isinstance(getattr(torch, name, None), _TORCH_CONSTANTS):
            return getattr(torch, name)
        raise UnsafePickleError(f"it references {module}.{name}, which is not part of checkpoint metadata")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError("it holds a persistent reference, which checkpoint metadata never does")


def load_dcp_metadata(source: Union[str, BinaryIO]) -> Any:
    """torch.distributed.checkpoint `Metadata` from a `.metadata` file (path or binary stream), through the
    allow-list. Raises UnsafePickleError for a foreign global or anything that is not a `Metadata`."""
    from torch.distributed.checkpoint.metadata import Metadata

    if isinstance(source, str):
        with open(source, "rb") as f:
            return load_dcp_metadata(f)
    try:
        md = AllowListUnpickler(source).load()
    except UnsafePickleError:
        raise
    except Exception as e:  # noqa: BLE001 - a corrupt pickle fails in many ways; all mean "unreadable"
        raise UnsafePickleError(f"it is not a readable pickle ({type(e).__name__}: {e})") from None
    if not isinstance(md, Metadata):
        raise UnsafePickleError(f"it holds a {type(md).__name__}, not torch.distributed.checkpoint Metadata")
    return md


def check_torch_pickle(source: Union[str, bytes]) -> None:
    """Raise UnsafePickleError when a `torch.save` file or byte string cannot be read with torch's allow-list
    loader (`weights_only=True`): it references something other than tensors and plain containers."""
    try:
        torch.load(io.BytesIO(source) if isinstance(source, bytes) else source, map_location="cpu",
                   weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()
        detail = next((line for line in first if "GLOBAL" in line or "Unsupported" in line), first[0] if first else "")
        raise UnsafePickleError(f"torch's weights-only loader refuses it ({detail.strip()[:300]})") from None
    except Exception as e:  # noqa: BLE001 - a corrupt archive: report it the same way
        raise UnsafePickleError(f"it is not a readable torch.save file ({type(e).__name__}: {e})") from None


def safe_filesystem_reader(path: str) -> Any:
    """A torch.distributed.checkpoint FileSystemReader for `path` whose `read_metadata` uses the allow-list
    (torch's reads `.metadata` with a bare `pickle.load`, and calls it again on every `dcp.load`)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            md_path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(md_path, "rb") as f:
                md = load_dcp_metadata(f)
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return SafeFileSystemReader(path)
