"""`megappo data gsm8k`: GSM8K jsonl / Hugging Face Parquet -> train/test Parquet in verl's schema."""
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from megappo.cli import main
from megappo.data import DataError, PromptDataset
from megappo.data.gsm8k import INSTRUCTION, SCHEMA, convert
from megappo.rewards import default_compute_score

# CI lays shared/ beside the repository: <repo>/../shared/data/gsm8k.
SHARED_GSM8K = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "gsm8k"

TRAIN = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A car costs $1,234 more. Total?", "answer": "It is $1,234.\n#### 1,234"},
    {"question": "Owed?", "answer": "He owes 5.\n#### -5"},
]
TEST = [{"question": "Half of 10?", "answer": "10 / 2 = 5\n#### 5"}]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture
def jsonl_dir(tmp_path):
    d = tmp_path / "raw"
    d.mkdir()
    write_jsonl(d / "train.jsonl", TRAIN)
    write_jsonl(d / "test.jsonl", TEST)
    return d


def read_rows(path):
    return pq.read_table(path).to_pylist()


def test_handmade_jsonl(jsonl_dir, tmp_path):
    out = tmp_path / "out"
    assert convert(str(jsonl_dir), str(out)) == {"train": 3, "test": 1}
    assert sorted(os.listdir(tmp_path)) == ["out", "raw"]  # no temporary directory left behind
    assert pq.read_schema(out / "train.parquet").equals(SCHEMA, check_metadata=False)
    rows = read_rows(out / "train.parquet")
    assert rows[1] == {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": TRAIN[1]["question"] + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "1234"},
        "extra_info": {"split": "train", "index": 1, "answer": TRAIN[1]["answer"], "question": TRAIN[1]["question"]},
    }
    assert INSTRUCTION == 'Let\'s think step by step and output the final answer after "####".'
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["7", "1234", "-5"]
    assert read_rows(out / "test.parquet")[0]["extra_info"]["split"] == "test"


def test_hugging_face_layout(tmp_path):
    src = tmp_path / "gsm8k_hf"
    (src / "main").mkdir(parents=True)
    for split, records in (("train", TRAIN), ("test", TEST)):
        pq.write_table(pa.Table.from_pylist(records), src / "main" / f"{split}-00000-of-00001.parquet")
    out = tmp_path / "out"
    assert convert(str(src), str(out)) == {"train": 3, "test": 1}
    assert [r["reward_model"]["ground_truth"] for r in read_rows(out / "train.parquet")] == ["7", "1234", "-5"]


def test_cli_refuses_to_overwrite_without_force(jsonl_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert main(["data", "gsm8k", "--input", str(jsonl_dir), "--out", str(out)]) == 0
    assert "train.parquet (3 prompts)" in capsys.readouterr().out
    before = (out / "train.parquet").read_bytes()
    write_jsonl(jsonl_dir / "train.jsonl", TRAIN[:2])
    assert main(["data", "gsm8k", "--input", str(jsonl_dir), "--out", str(out)]) == 1
    assert "already exist; pass --force" in capsys.readouterr().err
    assert (out / "train.parquet").read_bytes() == before
    assert main(["data", "gsm8k", "--input", str(jsonl_dir), "--out", str(out), "--force"]) == 0
    assert len(read_rows(out / "train.parquet")) == 2
    assert sorted(os.listdir(out)) == ["notes.txt", "test.parquet", "train.parquet"]


def test_bad_input_writes_nothing(jsonl_dir, tmp_path, capsys):
    out = tmp_path / "out"
    with open(jsonl_dir / "test.jsonl", "a") as f:
        f.write('{"question": "no final line", "answer": "it is 3"}\n')
    with pytest.raises(DataError, match=r"test.jsonl, line 2, row 1, column 'answer': the answer has no '#### N'"):
        convert(str(jsonl_dir), str(out))
    assert not out.exists() and sorted(os.listdir(tmp_path)) == ["raw"]
    (jsonl_dir / "test.jsonl").write_text('{"question": "q"}\n')
    assert main(["data", "gsm8k", "--input", str(jsonl_dir), "--out", str(out)]) == 1
    assert "line 1 has no string 'answer'" in capsys.readouterr().err
    (jsonl_dir / "test.jsonl").unlink()
    with pytest.raises(DataError, match="no test split found"):
        convert(str(jsonl_dir), str(out))
    assert not out.exists()


def test_help(capsys):
    with pytest.raises(SystemExit) as info:
        main(["data", "gsm8k", "--help"])
    assert info.value.code == 0
    assert "--force" in capsys.readouterr().out


@pytest.mark.skipif(not (SHARED_GSM8K / "train.jsonl").exists(), reason=f"GSM8K not found at {SHARED_GSM8K}")
def test_real_gsm8k(tmp_path, tokenizer_dir):
    out = tmp_path / "gsm8k"
    assert convert(str(SHARED_GSM8K), str(out)) == {"train": 7473, "test": 1319}
    first = json.loads((SHARED_GSM8K / "train.jsonl").open().readline())
    for split in ("train", "test"):
        rows = read_rows(out / f"{split}.parquet")
        assert pq.ParquetFile(out / f"{split}.parquet").num_row_groups > 1
        # Every reference solution scores 1 against its own parsed ground truth (thousands separators included).
        for row in rows:
            gt = row["reward_model"]["ground_truth"]
            assert "," not in gt
            assert default_compute_score(row["data_source"], row["extra_info"]["answer"], gt, None) == 1.0, row
    assert read_rows(out / "train.parquet")[0]["extra_info"]["question"] == first["question"]
    ds = PromptDataset(str(out / "test.parquet"), AutoTokenizer.from_pretrained(tokenizer_dir),
                       max_prompt_length=1024)
    assert len(ds) == 1319 and ds[0].row.data_source == "openai/gsm8k"
