"""The one shape of a config rule's message, shared by every rule set (the config's own, the capabilities'
`checks.py`, the trainer's preflight), and settings read from config sections by field name. Plain Python, so the
config package may import it without loading torch."""
from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")


def need(errors: list[str], ok: bool, key: str, problem: str, fix: str) -> None:
    """Unless `ok`, one ConfigError line: the key, what is wrong with it, the fix."""
    if not ok:
        errors.append(f"{key}: {problem}; {fix}")


def by_name(cls: type[T], *sources: Any, **given: Any) -> T:
    """A `cls` dataclass whose fields take `given`, else the value of the same name on the first source that has
    one, else their defaults: a setting named as its config key needs no line of mapping."""
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in given:
            values[f.name] = given[f.name]
            continue
        source = next((s for s in sources if hasattr(s, f.name)), None)
        if source is not None:
            values[f.name] = getattr(source, f.name)
    return cls(**values)
