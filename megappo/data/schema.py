"""The prompt Parquet schema (verl's) and a reader that checks it row group by row group.

    data_source   string                               picks the reward function
    prompt        list<struct<role, content: string>>  the chat messages (the column name is `prompt_key`)
    ability       string                               optional, e.g. "math"
    reward_model  struct<style, ground_truth>          ground_truth is given to the reward function
    extra_info    struct<...>                          optional, given to the reward function
    agent_name    string                               optional, the agent that runs the row's episode (verl's;
                                                       null: rollout.agent.default_agent_loop)
    images        list<struct<bytes, path>>            optional, a multimodal prompt's images (column `image_key`;
                                                       see megappo.data.multimodal)

Every problem raises `DataError` naming the file, the row (0-based, counted over the whole file) and the column,
and saying how to fix it.
"""
from __future__ import annotations

import glob
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from megappo.data.errors import DataError, converter_hint
from megappo.data.multimodal import check_images_column

REQUIRED_COLUMNS = ("data_source", "reward_model")  # plus the prompt column
OPTIONAL_COLUMNS = ("ability", "extra_info", "agent_name")
_SCHEMA_HINT = (
    "write it in verl's schema: data_source (string), prompt (list of {role, content} structs), ability (string), "
    "reward_model (struct with ground_truth), extra_info (struct); `megappo data gsm8k` writes an example"
)


@dataclass
class PromptRow:
    """One validated row, as Python objects."""

    messages: list[dict]  # [{"role": str, "content": str, ...}, ...], at least one
    data_source: str
    ability: str  # "" when the file has no ability column
    ground_truth: Any  # reward_model.ground_truth; usually a string, None when absent
    extra_info: dict  # {} when the file has no extra_info column
    file_row: int  # row number within its file
    images: Optional[list] = None  # the raw `images` cell ([{bytes, path}, ...]) when the file has the column
    agent_name: Optional[str] = None  # the `agent_name` cell (None: no column, or null)


def expand_files(files: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """One path, a list of paths, or directories (all *.parquet inside, sorted) -> a list of existing files."""
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    out: list[str] = []
    for f in files:
        path = os.path.expanduser(os.fspath(f))
        if os.path.isdir(path):
            found = sorted(glob.glob(os.path.join(path, "*.parquet")))
            if not found:
                raise DataError(path, "the directory holds no *.parquet files", "point data.train_files/val_files "
                                "at Parquet files, e.g. the output of `megappo data gsm8k`")
            out.extend(found)
        elif not os.path.exists(path):
            raise DataError(path, "file not found", "check data.train_files/val_files (one path or a list), or "
                            + converter_hint(os.fspath(f)))
        else:
            out.append(path)
    if not out:
        raise DataError("data.train_files/val_files", "no files given", "give one Parquet path or a list of them")
    return out


def _is_string(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t)


def _check_schema(path: str, schema: pa.Schema, prompt_key: str, image_key: str = "images") -> list[str]:
    """Check column presence and types; returns the columns to read."""
    names = set(schema.names)
    for col in (prompt_key, *REQUIRED_COLUMNS):
        if col not in names:
            fix = _SCHEMA_HINT + (", or set data.prompt_key to the column of chat messages" if col == prompt_key
                                  else "")
            raise DataError(path, f"missing column (columns: {', '.join(schema.names)})", fix, column=col)

    def wrong(col: str, expected: str) -> DataError:
        return DataError(path, f"type {schema.field(col).type} where {expected} was expected", _SCHEMA_HINT,
                         column=col)

    if not _is_string(schema.field("data_source").type):
        raise wrong("data_source", "string")
    prompt_t = schema.field(prompt_key).type
    if not (pa.types.is_list(prompt_t) or pa.types.is_large_list(prompt_t)) or not pa.types.is_struct(
        prompt_t.value_type
    ):
        raise wrong(prompt_key, "a list of {role, content} structs (a plain string prompt must be wrapped as "
                                "[{'role': 'user', 'content': ...}])")
    msg_t = prompt_t.value_type
    msg_fields = {msg_t.field(i).name: msg_t.field(i).type for i in range(msg_t.num_fields)}
    for key in ("role", "content"):
        if key not in msg_fields or not _is_string(msg_fields[key]):
            raise wrong(prompt_key, f"messages with a string '{key}'")
    rm_t = schema.field("reward_model").type
    if not pa.types.is_struct(rm_t) or rm_t.get_field_index("ground_truth") < 0:
        raise wrong("reward_model", "a struct with a 'ground_truth' field")
    if "ability" in names and not _is_string(schema.field("ability").type):
        raise wrong("ability", "string")
    if "agent_name" in names and not (_is_string(schema.field("agent_name").type)
                                      or pa.types.is_null(schema.field("agent_name").type)):
        raise wrong("agent_name", "string")
    if "extra_info" in names:
        t = schema.field("extra_info").type
        if not (pa.types.is_struct(t) or pa.types.is_map(t) or pa.types.is_null(t)):
            raise wrong("extra_info", "a struct")
    check_images_column(schema, image_key, wrong)
    return [prompt_key, *REQUIRED_COLUMNS, *(c for c in (*OPTIONAL_COLUMNS, image_key) if c in names)]


def open_parquet(path: str) -> pq.ParquetFile:
    if os.path.getsize(path) == 0:
        raise DataError(path, "the file is empty (0 bytes)", "regenerate it; a crashed writer leaves such files")
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(path, f"not a Parquet file ({e})", "convert the data to Parquet in verl's schema "
                        "(jsonl/csv are not read directly; `megappo data gsm8k` shows how)") from e


def read_prompt_rows(path: str, prompt_key: str = "prompt", batch_rows: int = 1024, image_key: str = "images"
                     ) -> Iterator[list[PromptRow]]:
    """Yield the rows of one Parquet file in chunks of at most `batch_rows`, validated; never the whole file."""
    pf = open_parquet(path)
    columns = _check_schema(path, pf.schema_arrow, prompt_key, image_key)
    if pf.metadata.num_rows == 0:
        raise DataError(path, "the file has no rows", "regenerate it or drop it from data.train_files/val_files")
    base = 0
    for batch in pf.iter_batches(batch_size=batch_rows, columns=columns):
        cols = {name: batch.column(name).to_pylist() for name in columns}
        rows = []
        for j in range(batch.num_rows):
            rows.append(_to_row(path, base + j, cols, j, prompt_key, image_key))
        base += batch.num_rows
        yield rows


def _to_row(path: str, row: int, cols: dict[str, list], j: int, prompt_key: str, image_key: str) -> PromptRow:
    data_source = cols["data_source"][j]
    if not data_source:
        raise DataError(path, "data_source is null or empty", "set data_source so a reward function can be "
                        "chosen (e.g. 'openai/gsm8k')", row=row, column="data_source")
    messages = cols[prompt_key][j]
    if not messages:
        raise DataError(path, "the prompt has no messages", "drop the row or give it at least one "
                        "{role, content} message", row=row, column=prompt_key)
    for k, m in enumerate(messages):
        if m is None or m.get("role") is None or m.get("content") is None:
            raise DataError(path, f"message {k} has a null role or content", "give every message a string role "
                            "and content", row=row, column=prompt_key)
    reward_model = cols["reward_model"][j]
    extra_info = _cell(cols, "extra_info", j)
    if isinstance(extra_info, list):  # a Parquet map reads as [(key, value), ...]
        extra_info = dict(extra_info)
    return PromptRow(
        messages=messages,
        data_source=data_source,
        ability=(cols["ability"][j] or "") if "ability" in cols else "",
        ground_truth=reward_model.get("ground_truth") if reward_model else None,
        extra_info=extra_info or {},
        file_row=row,
        images=_cell(cols, image_key, j),
        agent_name=_cell(cols, "agent_name", j) or None,
    )


def _cell(cols: dict[str, list], column: str, j: int) -> Any:
    """Row j of an optional column (None when the file has no such column)."""
    return cols[column][j] if column in cols else None


def write_parquet_atomic(table: pa.Table, target: str, row_group_size: int) -> None:
    """Write `table` to `target` through a temporary file in its folder renamed into place (a failure leaves no
    partial file), with the permissions a plain open would give."""
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.tmp-", dir=os.path.dirname(target))
    os.close(fd)
    try:
        pq.write_table(table, tmp, row_group_size=row_group_size)
        os.chmod(tmp, 0o666 & ~umask())
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def split_targets(out_dir: str, splits: Sequence[str], force: bool) -> dict[str, str]:
    """`out_dir/<split>.parquet` for each split; FileExistsError naming those already there unless `force` (asked
    before any input is read, so a refusal costs nothing)."""
    targets = {split: os.path.join(out_dir, f"{split}.parquet") for split in splits}
    existing = [p for p in targets.values() if os.path.exists(p)]
    if existing and not force:
        raise FileExistsError(f"{', '.join(existing)} already exist; pass --force to overwrite them")
    return targets


def write_splits_atomic(tables: dict[str, pa.Table], out_dir: str, row_group_size: int) -> None:
    """Write each table to `out_dir/<split>.parquet` through a temporary directory beside `out_dir`: a new `out_dir`
    appears at once with every split, an existing one gets each file whole (other files in it are kept). A failure
    leaves no partial output."""
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        os.chmod(tmp, 0o777 & ~umask())  # mkdtemp's 0700 would become out_dir's: give it what mkdir would
        for split, table in tables.items():
            pq.write_table(table, os.path.join(tmp, f"{split}.parquet"), row_group_size=row_group_size)
        if not os.path.exists(out_dir):
            os.rename(tmp, out_dir)
        else:
            for split in tables:
                os.replace(os.path.join(tmp, f"{split}.parquet"), os.path.join(out_dir, f"{split}.parquet"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def umask() -> int:
    """The process's umask (reading it means setting it: it is put straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
