"""No foreign code runs when a megatron checkpoint is loaded: `.metadata` goes through the allow-list unpickler,
`common.pt` and the objects stored in `.distcp` files through torch's weights-only loader, all in
`verify_checkpoint` (which every load calls) before torch or megatron unpickle them. Each crafted payload would
create a file if it ran; the tests check it does not exist."""
from __future__ import annotations

import ast
import io
import os
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch

from megappo.models.checkpoint import CheckpointError, verify_checkpoint
from megappo.models.safe_pickle import UnsafePickleError, load_dcp_metadata, safe_filesystem_reader


class _Payload:
    """Unpickling this runs `touch <path>`."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


@pytest.fixture(scope="module")
def ckpt(hf_model_dir, tmp_path_factory):
    """A real megatron checkpoint (tiny qwen2-MoE, bucketed save: byte objects in the .distcp files)."""
    from megappo.cli import main

    out = tmp_path_factory.mktemp("safe_pickle") / "ckpt"
    assert main(["convert", "hf-to-mcore", "--hf", hf_model_dir("qwen2_moe"), "--out", str(out),
                 "--bucket-size", "256KiB"]) == 0
    return out


@pytest.fixture
def copy(ckpt, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(ckpt, d)
    return d


def test_real_checkpoint_metadata_reads_through_the_allow_list(ckpt):
    from torch.distributed.checkpoint import FileSystemReader

    ours = load_dcp_metadata(str(ckpt / ".metadata"))
    theirs = FileSystemReader(str(ckpt)).read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata and ours.storage_data == theirs.storage_data
    assert safe_filesystem_reader(str(ckpt)).read_metadata().state_dict_metadata == theirs.state_dict_metadata
    assert verify_checkpoint(str(ckpt))["role"] == "actor"


def test_foreign_global_in_metadata_is_refused_before_it_runs(ckpt, copy, tmp_path, capsys):
    from megappo.cli import main

    ran = tmp_path / "metadata_payload_ran"
    with open(copy / ".metadata", "wb") as f:
        pickle.dump(_Payload(ran), f)
    with pytest.raises(CheckpointError, match=r"/\.metadata: refused to load: it references posix\.system"):
        verify_checkpoint(str(copy))
    with pytest.raises(UnsafePickleError, match="posix.system"):
        safe_filesystem_reader(str(copy)).read_metadata()
    capsys.readouterr()
    assert main(["convert", "mcore-to-hf", "--mcore", str(copy), "--out", str(tmp_path / "hf")]) == 2
    assert "refused to load" in capsys.readouterr().err
    # hidden in a field of genuine metadata
    md = load_dcp_metadata(str(ckpt / ".metadata"))
    md.planner_data = {"note": _Payload(ran)}
    with open(copy / ".metadata", "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(CheckpointError, match="refused to load: it references posix.system"):
        verify_checkpoint(str(copy))
    # not metadata at all
    with open(copy / ".metadata", "wb") as f:
        pickle.dump({"just": "a dict"}, f)
    with pytest.raises(CheckpointError, match="holds a dict, not torch.distributed.checkpoint Metadata"):
        verify_checkpoint(str(copy))
    assert not ran.exists() and not (tmp_path / "hf").exists()


def test_foreign_code_in_common_state_or_stored_objects_is_refused(ckpt, copy, tmp_path):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    ran = tmp_path / "object_payload_ran"
    torch.save({"extra": _Payload(ran)}, copy / "common.pt")
    with pytest.raises(CheckpointError, match=r"common\.pt: refused to load: .*posix\.system"):
        verify_checkpoint(str(copy))
    shutil.copy(ckpt / "common.pt", copy / "common.pt")
    # point one stored object (a ShardedObject; torch's load planner would torch.load it with weights_only=False)
    # at a payload in a new .distcp file
    md = load_dcp_metadata(str(ckpt / ".metadata"))
    key = next(k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
    buf = io.BytesIO()
    torch.save(_Payload(ran), buf)
    (copy / "evil.distcp").write_bytes(buf.getvalue())
    for index, storage in md.storage_data.items():
        if index.fqn == key:
            md.storage_data[index] = type(storage)(relative_path="evil.distcp", offset=0, length=len(buf.getvalue()))
    with open(copy / ".metadata", "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(CheckpointError, match=rf"evil\.distcp \(object '{re.escape(key)}'\): refused to load"):
        verify_checkpoint(str(copy))
    # a path outside the checkpoint
    for index, storage in md.storage_data.items():
        if index.fqn == key:
            md.storage_data[index] = type(storage)(relative_path="../elsewhere.distcp", offset=0, length=1)
    with open(copy / ".metadata", "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(CheckpointError, match="points outside the checkpoint"):
        verify_checkpoint(str(copy))
    assert not ran.exists()


def test_megappo_code_loads_torch_files_weights_only():
    """Every torch.load in megappo (outside megappo/testing, which reads its own subprocesses' results) passes
    weights_only=True."""
    root = Path(__file__).resolve().parents[2] / "megappo"
    bad = []
    for path in root.rglob("*.py"):
        if "testing" in path.relative_to(root).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
                kw = {k.arg: k.value for k in node.keywords}
                if not (isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True):
                    bad.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not bad, bad
