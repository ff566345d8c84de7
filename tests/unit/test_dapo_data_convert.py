"""`megappo data dapo-math` / `megappo data aime2024`: the shipped samples in, verl-schema Parquet out."""
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megappo.cli import main
from megappo.data.dapo import PROMPT_TEMPLATE, convert_aime2024, convert_dapo_math
from megappo.data.errors import DataError
from megappo.data.schema import read_prompt_rows
from megappo.rewards import default_compute_score

SAMPLES = Path(__file__).resolve().parents[2] / "megappo" / "data" / "samples"


def _rows(path):
    return [r for chunk in read_prompt_rows(str(path)) for r in chunk]


def test_dapo_math_sample_converts_and_drops_copies(tmp_path, capsys):
    assert main(["data", "dapo-math", "--input", str(SAMPLES / "dapo_math"), "--out", str(tmp_path)]) == 0
    assert "(6 prompts)" in capsys.readouterr().out
    rows = _rows(tmp_path / "dapo-math-17k.parquet")
    assert len(rows) == 6 and {r.data_source for r in rows} == {"math_dapo"}
    assert rows[0].messages[0]["role"] == "user" and "Answer: $Answer" in rows[0].messages[0]["content"]
    assert rows[0].extra_info == {"index": "00000000-0000-4000-8000-000000000000", "split": "train"}
    assert default_compute_score(rows[0].data_source, "so 91.\nAnswer: 91", rows[0].ground_truth)["score"] == 1.0
    _, n = convert_dapo_math(str(SAMPLES / "dapo_math"), str(tmp_path), force=True, keep_duplicates=True)
    assert n == 8
    assert main(["data", "dapo-math", "--input", str(SAMPLES / "dapo_math"), "--out", str(tmp_path)]) == 1
    assert "--force" in capsys.readouterr().err


def test_aime_both_layouts(tmp_path):
    path, n = convert_aime2024(str(SAMPLES / "aime2024"), str(tmp_path / "a"))
    rows = _rows(path)
    assert n == 4 and rows[0].data_source == "aime2024" and rows[0].ground_truth == "130"
    assert rows[0].messages[0]["content"].startswith(PROMPT_TEMPLATE.split("{problem}")[0])
    assert rows[0].extra_info == {"index": "2024-I-1", "split": "test"}
    assert default_compute_score("aime2024", "Answer: \\boxed{130}", "130")["acc"]
    # verl's AIME-2024 layout: already in verl's schema, each problem repeated (32 times in the public file)
    table = pq.read_table(path)
    verl_dir = tmp_path / "verl" / "data"
    verl_dir.mkdir(parents=True)
    pq.write_table(pa.concat_tables([table] * 3), verl_dir / "aime-2024.parquet")
    _, n = convert_aime2024(str(tmp_path / "verl"), str(tmp_path / "b"))
    assert n == 4
    _, n = convert_aime2024(str(tmp_path / "verl"), str(tmp_path / "c"), keep_duplicates=True)
    assert n == 12


def test_bad_inputs_name_the_fix(tmp_path):
    with pytest.raises(DataError, match="no such file or directory.*Fix: pass --input"):
        convert_dapo_math(str(tmp_path / "missing"), str(tmp_path / "out"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "dapo-math-17k.parquet").write_bytes(b"")
    with pytest.raises(DataError, match="empty"):
        convert_dapo_math(str(bad), str(tmp_path / "out"))
    pq.write_table(pa.table({"question": ["q"], "answer": ["1"]}), bad / "dapo-math-17k.parquet")
    with pytest.raises(DataError, match="not DAPO-Math-17k.*Fix: pass the dapo-math-17k.parquet"):
        convert_dapo_math(str(bad), str(tmp_path / "out"))
    with pytest.raises(DataError, match="neither Maxwell-Jia"):
        convert_aime2024(str(bad / "dapo-math-17k.parquet"), str(tmp_path / "out"))
    two = tmp_path / "two"
    shutil.copytree(bad, two)
    shutil.copy(bad / "dapo-math-17k.parquet", two / "other.parquet")
    with pytest.raises(DataError, match="no aime-2024.parquet or aime_2024_problems.parquet here and 2 other"):
        convert_aime2024(str(two), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_each_converter_refuses_the_other_ones_file_naming_it(tmp_path):
    with pytest.raises(DataError, match="looks like DAPO-Math-17k.*its name says DAPO-Math.*megappo data dapo-math"):
        convert_aime2024(str(SAMPLES / "dapo_math"), str(tmp_path / "out"))
    # a DAPO-Math file under another name: more distinct problems than AIME has
    table = pq.read_table(SAMPLES / "dapo_math" / "dapo-math-17k.parquet").to_pylist()
    many = [{**row, "prompt": [{**row["prompt"][0], "content": f"{i}: " + row["prompt"][0]["content"]}]}
            for i, row in enumerate(table * 10)]
    pq.write_table(pa.Table.from_pylist(many), tmp_path / "train.parquet")
    with pytest.raises(DataError, match="it holds 80 distinct problems; AIME 2024 has 30.*megappo data dapo-math"):
        convert_aime2024(str(tmp_path / "train.parquet"), str(tmp_path / "out"))
    with pytest.raises(DataError, match="this is AIME 2024.*megappo data aime2024 --input"):
        convert_dapo_math(str(SAMPLES / "aime2024"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_a_missing_data_file_names_its_datasets_converter():
    from megappo.data.errors import converter_hint

    assert "`megappo data gsm8k --input DIR --out ~/data/gsm8k`" in converter_hint("~/data/gsm8k/train.parquet")
    assert "`megappo data dapo-math --input DIR --out ~/data/dapo`" in converter_hint(
        "~/data/dapo/dapo-math-17k.parquet")
    assert "`megappo data aime2024 --input DIR --out ~/data/dapo`" in converter_hint("~/data/dapo/aime-2024.parquet")
    assert "`megappo data geo3k --input DIR --out ~/data/geo3k`" in converter_hint("~/data/geo3k/test.parquet")
    assert "gsm8k, geo3k, dapo-math, aime2024" in converter_hint("/data/mine.parquet")
