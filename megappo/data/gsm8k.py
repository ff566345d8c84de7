"""GSM8K -> train.parquet / test.parquet in verl's prompt schema (as verl's examples/data_preprocess/gsm8k.py).

Inputs, either layout:
- jsonl: DIR/train.jsonl and DIR/test.jsonl, one {"question", "answer"} object a line (the original release);
- Hugging Face dataset: DIR/main/train-*.parquet and DIR/main/test-*.parquet (or those files directly in DIR),
  with string columns question and answer.
"""
from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass

import pyarrow as pa

from megappo.data.schema import DataError, open_parquet, split_targets, write_splits_atomic

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
SPLITS = ("train", "test")
ROW_GROUP_SIZE = 1024  # rows per Parquet row group; the dataset reads one group at a time

SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
    ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64()), ("answer", pa.string()),
                              ("question", pa.string())])),
])

_ANSWER_RE = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass
class Example:
    question: str
    answer: str  # the reference solution, ending in "#### N"
    source: str  # "file" or "file, line N": for error messages
    row: int  # 0-based position in its file


def parse_ground_truth(answer: str, source: str, row: int) -> str:
    """The number after the last "####" of a reference solution, thousands separators removed ("1,234" -> "1234")."""
    if "####" not in answer:
        raise DataError(source, "the answer has no '#### N' final line", "use GSM8K's original answers",
                        row=row, column="answer")
    value = answer.rsplit("####", 1)[1].strip().replace(",", "").replace("$", "")
    if not _ANSWER_RE.fullmatch(value):
        raise DataError(source, f"the final answer {value!r} after '####' is not a number", "fix the answer line",
                        row=row, column="answer")
    return value


def _split_inputs(input_dir: str, split: str) -> tuple[str, list[str]]:
    """("jsonl" | "parquet", files) for one split; DataError when the split is in neither layout."""
    jsonl = os.path.join(input_dir, f"{split}.jsonl")
    if os.path.isfile(jsonl):
        return "jsonl", [jsonl]
    for sub in ("main", ""):
        shards = sorted(glob.glob(os.path.join(input_dir, sub, f"{split}-*.parquet")))
        if shards:
            return "parquet", shards
    raise DataError(input_dir, f"no {split} split found (looked for {split}.jsonl, main/{split}-*.parquet and "
                    f"{split}-*.parquet)", "point --input at GSM8K's jsonl files or a Hugging Face snapshot of "
                    "openai/gsm8k")


def _read_jsonl(path: str) -> list[Example]:
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(path, f"line {lineno} is not JSON ({e})", "fix or remove the line",
                                row=len(out)) from e
            for key in ("question", "answer"):
                if not isinstance(obj, dict) or not isinstance(obj.get(key), str):
                    raise DataError(path, f"line {lineno} has no string '{key}'", "every line needs "
                                    "{\"question\": str, \"answer\": str}", row=len(out), column=key)
            out.append(Example(obj["question"], obj["answer"], f"{path}, line {lineno}", len(out)))
    if not out:
        raise DataError(path, "the file has no examples", "use GSM8K's original train.jsonl/test.jsonl")
    return out


def _read_hf_parquet(paths: list[str]) -> list[Example]:
    out = []
    for path in paths:
        pf = open_parquet(path)
        names = pf.schema_arrow.names
        for key in ("question", "answer"):
            if key not in names:
                raise DataError(path, f"missing column (columns: {', '.join(names)})", "use the 'main' config of "
                                "the openai/gsm8k dataset", column=key)
            field_type = pf.schema_arrow.field(key).type
            if not (pa.types.is_string(field_type) or pa.types.is_large_string(field_type)):
                raise DataError(path, f"type {field_type}, expected string", "use the "
                                "'main' config of the openai/gsm8k dataset", column=key)
        row = 0
        for batch in pf.iter_batches(columns=["question", "answer"]):
            for q, a in zip(batch.column("question").to_pylist(), batch.column("answer").to_pylist()):
                if q is None or a is None:
                    raise DataError(path, "null question or answer", "drop the row", row=row,
                                    column="question" if q is None else "answer")
                out.append(Example(q, a, path, row))
                row += 1
    if not out:
        raise DataError(", ".join(paths), "no examples", "use a complete copy of openai/gsm8k")
    return out


def to_rows(examples: list[Example], split: str) -> list[dict]:
    """GSM8K examples -> rows of SCHEMA; `extra_info.index` is the example's position in its split."""
    rows = []
    for index, ex in enumerate(examples):
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": ex.question + " " + INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": parse_ground_truth(ex.answer, ex.source, ex.row)},
            "extra_info": {"split": split, "index": index, "answer": ex.answer, "question": ex.question},
        })
    return rows


def convert(input_dir: str, out_dir: str, force: bool = False) -> dict[str, int]:
    """Write out_dir/train.parquet and out_dir/test.parquet; returns the row count of each split.

    Everything is read and checked first, then written whole (`schema.write_splits_atomic`), so a failure leaves
    no partial output. Existing outputs are replaced only with `force`.
    """
    input_dir, out_dir = os.path.expanduser(input_dir), os.path.abspath(os.path.expanduser(out_dir))
    if not os.path.isdir(input_dir):
        raise DataError(input_dir, "input directory not found", "pass --input DIR holding train.jsonl and test.jsonl")
    split_targets(out_dir, SPLITS, force)

    tables = {}
    for split in SPLITS:
        kind, files = _split_inputs(input_dir, split)
        examples = _read_jsonl(files[0]) if kind == "jsonl" else _read_hf_parquet(files)
        tables[split] = pa.Table.from_pylist(to_rows(examples, split), schema=SCHEMA)

    write_splits_atomic(tables, out_dir, ROW_GROUP_SIZE)
    return {split: t.num_rows for split, t in tables.items()}
