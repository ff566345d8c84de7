"""DAPO-Math-17k and AIME 2024 -> Parquet in verl's prompt schema, as verl's DAPO recipe trains and validates on.

Inputs (a file, or a directory searched for it, also under data/ as in a Hugging Face snapshot):

- DAPO-Math-17k, `BytedTsinghua-SIA/DAPO-Math-17k` (data/dapo-math-17k.parquet): already in verl's schema,
  data_source "math_dapo", prompt [{role: user, content: instruction + problem}], ability, reward_model
  {ground_truth, style}, extra_info {index}. The public file holds every problem many times over (about 1.79M rows
  for ~17k problems); the copies are dropped (first one kept) unless --keep-duplicates.
- AIME 2024, either `Maxwell-Jia/AIME_2024` (aime_2024_problems.parquet: ID, Problem, Solution, Answer), which is
  given DAPO's prompt template and data_source "aime2024", or verl's `BytedTsinghua-SIA/AIME-2024`
  (data/aime-2024.parquet, verl's schema, each problem 32 times for avg@32), whose copies are dropped the same way:
  sample several answers per problem with actor_rollout_ref.rollout.val_kwargs.n instead (32: avg@32).

Both are scored by `megappo.rewards.math_dapo` (data_source math_dapo and every aime* source).
"""
from __future__ import annotations

import glob
import os

import pyarrow as pa

from megappo.data.schema import DataError, _check_schema, open_parquet, write_parquet_atomic

# DAPO-Math-17k's prompt (the AIME-2024 file of the DAPO release uses the same one)
PROMPT_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    "Remember to put your answer on its own line after \"Answer:\"."
)
AIME_DATA_SOURCE = "aime2024"
STYLE = "rule-lighteval/MATH_v2"
ROW_GROUP_SIZE = 1024
DAPO_FILE, AIME_FILE = "dapo-math-17k.parquet", "aime-2024.parquet"

SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
    ("extra_info", pa.struct([("index", pa.string()), ("split", pa.string())])),
])
_MAXWELL_COLUMNS = ("ID", "Problem", "Answer")


def find_input(path: str, names: tuple[str, ...], what: str) -> str:
    """`path` itself when it is a file, else the first of `names` in it (or in its data/), else its only Parquet."""
    path = os.path.expanduser(path)
    if os.path.isfile(path):
        return path
    if not os.path.isdir(path):
        raise DataError(path, "no such file or directory", f"pass --input the {what} Parquet file or its directory")
    for sub in ("", "data"):
        for name in names:
            if os.path.isfile(os.path.join(path, sub, name)):
                return os.path.join(path, sub, name)
    found = sorted(glob.glob(os.path.join(path, "*.parquet")) + glob.glob(os.path.join(path, "data", "*.parquet")))
    if len(found) == 1:
        return found[0]
    raise DataError(path, f"no {' or '.join(names)} here" + (f" and {len(found)} other Parquet files" if found
                    else ""), f"pass --input the {what} Parquet file itself")


def _verl_rows(path: str, split: str, keep_duplicates: bool) -> list[dict]:
    """Rows of a file already in verl's schema, checked, copies of a (prompt, answer) dropped unless asked."""
    pf = open_parquet(path)
    columns = _check_schema(path, pf.schema_arrow, "prompt")
    rows, seen, row = [], set(), 0
    for batch in pf.iter_batches(columns=columns, batch_size=ROW_GROUP_SIZE):
        for item in batch.to_pylist():
            messages, rm = item.get("prompt"), item.get("reward_model") or {}
            gt = rm.get("ground_truth")
            if not messages or any(m is None or m.get("content") is None for m in messages) or gt is None:
                raise DataError(path, "a prompt without messages or content, or no reward_model.ground_truth",
                                "use the published file unchanged", row=row)
            key = (tuple((m.get("role"), m["content"]) for m in messages), str(gt))
            row += 1
            if not keep_duplicates and key in seen:
                continue
            seen.add(key)
            extra = item.get("extra_info") or {}
            index = extra.get("index") if isinstance(extra, dict) else None
            rows.append({"data_source": item["data_source"],
                         "prompt": [{"role": m.get("role") or "user", "content": m["content"]} for m in messages],
                         "ability": item.get("ability") or "MATH",
                         "reward_model": {"style": rm.get("style") or STYLE, "ground_truth": str(gt)},
                         "extra_info": {"index": None if index is None else str(index), "split": split}})
    if not rows:
        raise DataError(path, "the file has no rows", "download it again")
    return rows


def _maxwell_rows(path: str) -> list[dict]:
    """Maxwell-Jia/AIME_2024 rows (ID, Problem, Solution, Answer) with DAPO's prompt."""
    pf = open_parquet(path)
    rows = []
    for batch in pf.iter_batches(columns=list(_MAXWELL_COLUMNS), batch_size=ROW_GROUP_SIZE):
        for item in batch.to_pylist():
            if item["Problem"] is None or item["Answer"] is None:
                raise DataError(path, "a row without Problem or Answer", "use the published file unchanged",
                                row=len(rows))
            rows.append({"data_source": AIME_DATA_SOURCE,
                         "prompt": [{"role": "user", "content": PROMPT_TEMPLATE.format(problem=item["Problem"])}],
                         "ability": "MATH",
                         "reward_model": {"style": STYLE, "ground_truth": str(item["Answer"]).strip()},
                         "extra_info": {"index": str(item["ID"]), "split": "test"}})
    if not rows:
        raise DataError(path, "the file has no rows", "download it again")
    return rows


def dapo_math_rows(path: str, keep_duplicates: bool = False) -> list[dict]:
    names = open_parquet(path).schema_arrow.names  # a clear error for an empty or non-Parquet file
    if all(c in names for c in _MAXWELL_COLUMNS) or "aime" in os.path.basename(path).lower():
        raise DataError(path, "this is AIME 2024, DAPO's validation set, not DAPO-Math-17k",
                        f"convert it with `megappo data aime2024 --input {path}`, and pass this command the "
                        "dapo-math-17k.parquet of BytedTsinghua-SIA/DAPO-Math-17k")
    if "prompt" not in names:
        raise DataError(path, f"not DAPO-Math-17k (columns: {', '.join(names)})",
                        "pass the dapo-math-17k.parquet of BytedTsinghua-SIA/DAPO-Math-17k")
    return _verl_rows(path, "train", keep_duplicates)


# AIME has 15 problems per contest, two contests a year: a file with more distinct problems is another set
_MOST_AIME_PROBLEMS = 60


def aime_rows(path: str, keep_duplicates: bool = False) -> list[dict]:
    names = open_parquet(path).schema_arrow.names
    if all(c in names for c in _MAXWELL_COLUMNS):
        return _maxwell_rows(path)
    if "prompt" in names:
        dapo = "dapo" in os.path.basename(path).lower()
        rows = [] if dapo else _verl_rows(path, "test", keep_duplicates)
        problems = len({r["prompt"][0]["content"] for r in rows})
        if dapo or problems > _MOST_AIME_PROBLEMS:
            found = "its name says DAPO-Math" if dapo else f"it holds {problems} distinct problems; AIME 2024 has 30"
            raise DataError(path, f"this looks like DAPO-Math-17k, DAPO's training set, not AIME 2024 ({found})",
                            f"convert it with `megappo data dapo-math --input {path}`, and pass this command "
                            "aime_2024_problems.parquet of Maxwell-Jia/AIME_2024 or aime-2024.parquet of "
                            "BytedTsinghua-SIA/AIME-2024")
        return rows
    raise DataError(path, f"neither Maxwell-Jia/AIME_2024 (ID, Problem, Answer) nor verl's AIME-2024 (prompt, "
                    f"reward_model) columns (columns: {', '.join(names)})", "pass aime_2024_problems.parquet of "
                    "Maxwell-Jia/AIME_2024 or aime-2024.parquet of BytedTsinghua-SIA/AIME-2024")


def write(rows: list[dict], out_dir: str, name: str, force: bool = False) -> str:
    """Write out_dir/name atomically (a temporary file renamed into place); existing files only with `force`."""
    out_dir = os.path.abspath(os.path.expanduser(out_dir))
    target = os.path.join(out_dir, name)
    if os.path.exists(target) and not force:
        raise FileExistsError(f"{target} already exists; pass --force to overwrite it")
    os.makedirs(out_dir, exist_ok=True)
    write_parquet_atomic(pa.Table.from_pylist(rows, schema=SCHEMA), target, ROW_GROUP_SIZE)
    return target


def convert_dapo_math(input_path: str, out_dir: str, force: bool = False, keep_duplicates: bool = False):
    path = find_input(input_path, (DAPO_FILE,), "DAPO-Math-17k")
    rows = dapo_math_rows(path, keep_duplicates)
    return write(rows, out_dir, DAPO_FILE, force), len(rows)


def convert_aime2024(input_path: str, out_dir: str, force: bool = False, keep_duplicates: bool = False):
    path = find_input(input_path, (AIME_FILE, "aime_2024_problems.parquet"), "AIME 2024")
    rows = aime_rows(path, keep_duplicates)
    return write(rows, out_dir, AIME_FILE, force), len(rows)

