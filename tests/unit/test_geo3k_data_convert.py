"""`megappo data geo3k`: the shipped hiyouga/geometry3k-shaped sample and Inter-GPS's folder layout in, verl's
multimodal Parquet out (images as bytes, one <image> per image)."""
import io
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from PIL import Image

from megappo.cli import main
from megappo.data.errors import DataError
from megappo.data.geo3k import DATA_SOURCE, INSTRUCTION, convert
from megappo.data.schema import read_prompt_rows
from megappo.rewards import default_compute_score

SAMPLE = Path(__file__).resolve().parents[2] / "megappo" / "data" / "samples" / "geo3k"


def _rows(path):
    return pq.read_table(path).to_pylist()


def test_sample_converts_as_verl_does(tmp_path, capsys):
    assert main(["data", "geo3k", "--input", str(SAMPLE), "--output", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "train.parquet (4 prompts)" in out and "test.parquet (2 prompts)" in out
    train = _rows(tmp_path / "train.parquet")
    first = train[0]
    content = first["prompt"][0]["content"]
    assert first["prompt"][0]["role"] == "user" and content == "<image>Find x. " + INSTRUCTION
    assert content.count("<image>") == len(first["images"]) == 1 and first["images"][0]["path"] is None
    with Image.open(io.BytesIO(first["images"][0]["bytes"])) as im:
        assert im.size == (96, 96)
    assert (first["data_source"], first["ability"], first["reward_model"]) == \
        (DATA_SOURCE, "math", {"style": "rule", "ground_truth": "70"})
    assert first["extra_info"] == {"split": "train", "index": 0, "answer": "70", "question": "<image>Find x."}
    assert [r["reward_model"]["ground_truth"] for r in train] == ["70", "5", "2\\sqrt{3}", "9\\pi"]
    # the text columns pass the prompt reader's checks, and the answers score with the geo3k reward
    rows = [r for chunk in read_prompt_rows(str(tmp_path / "test.parquet")) for r in chunk]
    assert [r.ground_truth for r in rows] == ["10", "\\sqrt{2}"]
    assert default_compute_score(DATA_SOURCE, "<think>1 + 1 = 2</think> \\boxed{1.4142}", rows[1].ground_truth,
                                 rows[1].extra_info)["score"] == 1.0
    assert main(["data", "geo3k", "--input", str(SAMPLE), "--out", str(tmp_path)]) == 1
    assert "--force" in capsys.readouterr().err


def _intergps(root: Path, problems: dict) -> Path:
    """Inter-GPS's layout from the sample's images: split/<id>/data.json + img_diagram.png."""
    images = [im["bytes"] for r in _rows(SAMPLE / "data" / "train-00000-of-00001.parquet") for im in r["images"]]
    for split, ids in problems.items():
        for i, pid in enumerate(ids):
            folder = root / split / str(pid)
            folder.mkdir(parents=True)
            (folder / "img_diagram.png").write_bytes(images[i])
            (folder / "data.json").write_text(json.dumps({
                "id": pid, "problem_text": f"Find x in problem {pid}.", "annotat_text": f"Find x ({pid}).",
                "choices": ["1", "2", "3", str(pid)], "answer": "D", "precise_value": [1.0, 2.0, 3.0, float(pid)]}))
    return root


def test_intergps_folders(tmp_path):
    # ids in numeric order (10 after 9), the answer is the text of the lettered choice
    root = _intergps(tmp_path / "geometry3k", {"train": [9, 10, 2], "test": [2401]})
    assert convert(str(root), str(tmp_path / "out")) == {"train": 3, "test": 1}
    train = _rows(tmp_path / "out" / "train.parquet")
    assert [r["reward_model"]["ground_truth"] for r in train] == ["2", "9", "10"]
    assert train[1]["prompt"][0]["content"].startswith("<image>Find x (9). You FIRST think")
    assert train[1]["images"][0]["bytes"] == (root / "train" / "9" / "img_diagram.png").read_bytes()


def test_bad_inputs_name_the_fix(tmp_path):
    with pytest.raises(DataError, match="input directory not found.*Fix: pass --input"):
        convert(str(tmp_path / "missing"), str(tmp_path / "out"))
    with pytest.raises(DataError, match="no train split found.*hiyouga/geometry3k"):
        convert(str(tmp_path), str(tmp_path / "out"))
    root = _intergps(tmp_path / "g", {"train": [0], "test": [1]})
    (root / "test" / "1" / "img_diagram.png").write_bytes(b"not a png")
    with pytest.raises(DataError, match="img_diagram.png: an image cannot be decoded"):
        convert(str(root), str(tmp_path / "out"))
    (root / "test" / "1" / "data.json").write_text(json.dumps({"annotat_text": "Find x.", "choices": ["1"],
                                                               "answer": "C"}))
    with pytest.raises(DataError, match="answer letter within the choices"):
        convert(str(root), str(tmp_path / "out"))
    # a Parquet file with a problem whose placeholders do not match its images
    table = pq.read_table(SAMPLE / "data" / "test-00000-of-00001.parquet")
    hf = tmp_path / "hf"
    hf.mkdir()
    pq.write_table(pq.read_table(SAMPLE / "data" / "train-00000-of-00001.parquet"), hf / "train-0.parquet")
    pq.write_table(table.set_column(1, "problem", [["<image><image>Find x.", "Find x."]]), hf / "test-0.parquet")
    with pytest.raises(DataError, match="row 0, column 'problem': the problem has 2 '<image>' placeholders for 1"):
        convert(str(hf), str(tmp_path / "out"))
    pq.write_table(table.drop_columns(["images"]), hf / "test-0.parquet")
    with pytest.raises(DataError, match="column 'images': missing column"):
        convert(str(hf), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()  # nothing was written
