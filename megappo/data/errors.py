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
