"""Bad input to `megappo convert`: every case exits with status 2 and one message that names the file or flag and
the fix (no traceback), destroys nothing (the input and foreign directories keep their files) and leaves no staging
directory behind. One process, tiny llama (TP1); the multi-rank abort is in tests/multirank/test_convert_abort.py.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import signal

import pytest

from megappo.cli import main


def _files(d) -> dict[str, int]:
    return {os.path.relpath(os.path.join(r, f), d): os.path.getsize(os.path.join(r, f))
            for r, _, fs in os.walk(d) for f in fs}


def _leftovers(parent) -> list[str]:
    return [f for f in os.listdir(parent) if ".tmp" in f]


def _fails(argv, capsys, *needles) -> str:
    """Run the command; it must exit 2 with one message containing every needle, and no traceback."""
    capsys.readouterr()
    assert main(["convert", *argv]) == 2, argv
    err = capsys.readouterr().err
    assert "Traceback" not in err and "error: " in err, err
    message = err[err.index("error: "):]  # after the progress bar, if one was drawn
    assert message.count("\n") == 1, message
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    return message


@pytest.fixture
def src(hf_model_dir, tmp_path):
    d = tmp_path / "src"
    shutil.copytree(hf_model_dir("llama"), d)
    return d


@pytest.fixture(scope="module")
def mcore(hf_model_dir, tmp_path_factory):
    """A megatron checkpoint of the tiny llama, written once (read-only for the tests)."""
    out = tmp_path_factory.mktemp("mcore") / "ckpt"
    assert main(["convert", "hf-to-mcore", "--hf", hf_model_dir("llama"), "--out", str(out)]) == 0
    return out


def test_force_never_deletes_the_input_or_foreign_directories(src, mcore, tmp_path, capsys):
    before = _files(src)
    h2m = ["hf-to-mcore", "--hf", str(src), "--force", "--out"]
    _fails([*h2m, str(src)], capsys, f"--out {src} is the input --hf", "choose an --out outside it")
    _fails([*h2m, str(tmp_path)], capsys, "contains the input --hf")
    _fails([*h2m, str(src / "sub")], capsys, "lies inside the input --hf")
    link = tmp_path / "link"
    link.symlink_to(src, target_is_directory=True)
    _fails([*h2m, str(link)], capsys, "is the input --hf")
    _fails(["hf-to-mcore", "--hf", str(link), "--out", str(src), "--force"], capsys, "is the input --hf")
    # a directory megappo did not write: kept, with or without --force
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    _fails(["hf-to-mcore", "--hf", str(src), "--out", str(foreign)], capsys, "already exists; pass --force")
    _fails([*h2m, str(foreign)], capsys, "was not written by megappo", "megappo_checkpoint.json", "nothing was deleted")
    (tmp_path / "a_file").write_text("x")
    _fails([*h2m, str(tmp_path / "a_file")], capsys, "is not a directory")
    # mcore-to-hf: the same rules for its input
    mcore_before = _files(mcore)
    m2h = ["mcore-to-hf", "--mcore", str(mcore), "--force", "--out"]
    _fails([*m2h, str(mcore)], capsys, "is the input --mcore")
    _fails([*m2h, str(mcore.parent)], capsys, "contains the input --mcore")
    _fails([*m2h, str(mcore / "hf")], capsys, "lies inside the input --mcore")
    _fails([*m2h, str(foreign)], capsys, "was not written by megappo")
    assert _files(src) == before and _files(mcore) == mcore_before and (foreign / "keep.txt").read_text() == "mine"
    # an empty directory, and directories megappo wrote (megatron or HF), are replaced with --force
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["convert", *m2h, str(empty)]) == 0 and (empty / "megappo_export.json").exists()
    assert main(["convert", *m2h, str(empty)]) == 0  # megappo's HF export: replaced again
    ckpt = tmp_path / "ckpt"
    assert main(["convert", "hf-to-mcore", "--hf", str(empty), "--out", str(ckpt)]) == 0
    assert main(["convert", "hf-to-mcore", "--hf", str(src), "--out", str(ckpt), "--force"]) == 0
    assert json.load(open(ckpt / "megappo_convert.json"))["source"] == str(src)
    assert _files(src) == before and not _leftovers(tmp_path) and not _leftovers(mcore.parent)


def test_malformed_files_and_flags_exit_2_naming_them(src, mcore, tmp_path, capsys):
    out = tmp_path / "out"
    h2m = ["hf-to-mcore", "--hf", str(src), "--out", str(out)]
    cfg_text = (src / "config.json").read_text()
    cfg = json.loads(cfg_text)
    (src / "config.json").write_text(cfg_text[:-20])
    _fails(h2m, capsys, f"{src}/config.json: not valid JSON", "restore it from the original model")
    (src / "config.json").write_text("[1, 2]")
    _fails(h2m, capsys, "config.json: holds a JSON list, not an object")
    (src / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "num_hidden_layers"}))
    _fails(h2m, capsys, "config.json: has no 'num_hidden_layers'")
    (src / "config.json").write_text(cfg_text)
    # a safetensors index without weight_map
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 1}}))
    _fails(h2m, capsys, "model.safetensors.index.json: has no \"weight_map\"")
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    _fails(h2m, capsys, "weight_map")
    os.remove(src / "model.safetensors.index.json")
    # flags
    _fails([*h2m, "--dtype", "float13"], capsys, "--dtype 'float13'", "use one of")
    _fails([*h2m, "--bucket-size", "lots"], capsys, "--bucket-size 'lots': not a positive size", "512MB")
    _fails([*h2m, "--bucket-size", "0"], capsys, "--bucket-size '0'")
    _fails([*h2m, "--tp", "0"], capsys, "--tp 0: must be at least 1")
    m2h = ["mcore-to-hf", "--mcore", str(mcore), "--out", str(out)]
    _fails([*m2h, "--max-shard-size=-5GB"], capsys, "--max-shard-size '-5GB'")
    _fails([*m2h, "--dtype", "int3"], capsys, "--dtype 'int3'")
    # mcore-to-hf with a malformed config.json next to the checkpoint (a copy: the fixture is shared)
    bad = tmp_path / "bad_mcore"
    shutil.copytree(mcore, bad)
    (bad / "config.json").write_text("{")
    _fails(["mcore-to-hf", "--mcore", str(bad), "--out", str(out)], capsys, f"{bad}/config.json: not valid JSON")
    assert not out.exists() and not _leftovers(tmp_path)


def test_verify_reads_only_a_local_directory(mcore, tmp_path, capsys):
    _fails(["verify", "--hf", "Qwen/Qwen2.5-0.5B", "--mcore", str(mcore)], capsys,
           "--hf Qwen/Qwen2.5-0.5B: no such local directory", "never downloads", "--local-dir")
    _fails(["verify", "--hf", str(tmp_path / "missing"), "--mcore", str(mcore)], capsys, "no such local directory")
    (tmp_path / "no_config").mkdir()
    _fails(["verify", "--hf", str(tmp_path / "no_config"), "--mcore", str(mcore)], capsys, "has no config.json")


def test_layout_that_does_not_fit_names_the_flag_before_the_torchrun_hint(hf_model_dir, tmp_path, capsys,
                                                                          monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    dense, moe, out = hf_model_dir("llama"), hf_model_dir("qwen2_moe"), str(tmp_path / "out")
    h2m = ["hf-to-mcore", "--out", out, "--hf"]
    _fails([*h2m, dense, "--tp", "3"], capsys, "--tp=3 does not divide num_attention_heads=4", "use one of 1, 2, 4",
           f"{dense}/config.json")
    _fails([*h2m, dense, "--pp", "8"], capsys, "num_hidden_layers=4 is not divisible by pp*vpp = 8", "--pp")
    _fails([*h2m, moe, "--ep", "3"], capsys, "--ep=3 does not divide num_experts=4")
    _fails([*h2m, dense, "--ep", "2"], capsys, "--ep=2 but the model has no experts")
    # a layout that fits still gets the torchrun hint
    with pytest.raises(SystemExit, match="torchrun --nproc-per-node 2"):
        main(["convert", *h2m, dense, "--tp", "2"])
    assert not os.path.exists(out)


def test_write_error_exits_2_and_leaves_nothing(src, mcore, tmp_path, capsys):
    """A file-size limit (what a full disk looks like to the writer): the error names the output, the staging
    directory is removed, nothing is published."""
    out_m, out_h = tmp_path / "m", tmp_path / "h"
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, old_limit[1]))
    try:
        _fails(["hf-to-mcore", "--hf", str(src), "--out", str(out_m)], capsys, f"writing {out_m} failed",
               "free space")
        _fails(["mcore-to-hf", "--mcore", str(mcore), "--out", str(out_h)], capsys,
               f"writing {out_h} failed: File too large")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert not out_m.exists() and not out_h.exists() and not _leftovers(tmp_path)


def test_concurrent_conversions_use_their_own_staging_directory(src, tmp_path):
    """Another run's staging directory next to the same output is left alone (the fixed name `<out>.tmp-convert`
    was removed by whichever run started second), and every run's is unique."""
    from megappo.convert.hf_io import StagingDir, unique_staging_dir

    out = tmp_path / "out"
    others = [tmp_path / "out.tmp-convert", tmp_path / f"{os.path.basename(unique_staging_dir(str(out)))}"]
    for d in others:
        d.mkdir()
        (d / "in_progress").write_text("another conversion")
    assert main(["convert", "hf-to-mcore", "--hf", str(src), "--out", str(out)]) == 0
    assert all((d / "in_progress").exists() for d in others)
    names = {unique_staging_dir(str(out)) for _ in range(100)} | {StagingDir(str(tmp_path / "x")).tmp for _ in range(3)}
    assert len(names) == 103
    assert sorted(_leftovers(tmp_path)) == sorted(d.name for d in others)
