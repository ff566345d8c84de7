"""The one exception a bad dataset raises (dependency-free, so the CLI can import it cheaply)."""
from __future__ import annotations


class DataError(ValueError):
    """A dataset file that cannot be used as it is; the message names the file, row, column and the fix."""

    def __init__(self, path: str, problem: str, fix: str, *, row: int | None = None, column: str | None = None):
        where = path
        if row is not None:
            where += f", row {row}"
        if column is not None:
            where += f", column '{column}'"
        super().__init__(f"{where}: {problem}. Fix: {fix}")
        self.path, self.row, self.column = path, row, column


# (what a path names, the `megappo data` converter that writes it), most specific first
_CONVERTERS = (("dapo-math", "dapo-math"), ("dapo_math", "dapo-math"), ("aime", "aime2024"), ("geo3k", "geo3k"),
               ("geometry3k", "geo3k"), ("gsm8k", "gsm8k"))


def converter_hint(path: str) -> str:
    """How to make the missing Parquet file `path`: the `megappo data` converter its name points to, writing into
    its directory; all of them when the name points to none."""
    import os

    name = path.replace("\\", "/").lower()
    for word, converter in _CONVERTERS:
        if word in name:
            return (f"make it with `megappo data {converter} --input DIR --out {os.path.dirname(path) or '.'}` "
                    "or point the key at your Parquet")
    return ("make it with the `megappo data` converter of its dataset (gsm8k, geo3k, dapo-math, aime2024; "
            "`megappo data --help`) or point the key at your Parquet")
