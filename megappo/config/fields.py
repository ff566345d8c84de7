"""The schema's shared field types, and reading the dataclass tree's type annotations: coercing recipe/CLI values,
checking values, naming types.

Only the handful of annotation shapes the schema uses are supported: bool, int, float, str, Any, Literal[...],
Optional/Union, list[X], dict[str, Any] and nested dataclasses ("groups").
"""
from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, Iterator, Literal, Union, get_args, get_origin

_NONE = type(None)

# Estimators of KL(actor || ref), per token; "+" variants use the value forward and k2's gradient backward.
KLKind = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "abs+", "mse+", "k2+",
                 "low_var_kl+", "k3+"]
LossAggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                      "seq-mean-token-sum-norm"]
DType = Literal["bfloat16", "float16", "float32"]


class ConfigError(ValueError):
    """One or more configuration problems; each line names the key and the fix."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        head = "invalid megappo config" + (f" ({len(self.errors)} problems)" if len(self.errors) > 1 else "")
        super().__init__(head + ":\n" + "\n".join(f"  - {e}" for e in self.errors))


class CoerceError(ValueError):
    """A value that does not fit a field's type; the message is the expected type in words."""


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    """Resolved annotations of a dataclass (the schema uses `from __future__ import annotations`)."""
    return typing.get_type_hints(cls)


def is_group(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def is_mapping_type(tp: Any) -> bool:
    return tp is dict or get_origin(tp) is dict


def allows_none(tp: Any) -> bool:
    return tp is Any or (get_origin(tp) is Union and _NONE in get_args(tp))


def accepts_str(tp: Any) -> bool:
    """Whether a plain string can be this type without parsing (str, a Literal of strings, or a Union with one)."""
    if tp is str:
        return True
    if get_origin(tp) is Literal:
        return all(isinstance(a, str) for a in get_args(tp))
    if get_origin(tp) is Union:
        return any(accepts_str(a) for a in get_args(tp) if a is not _NONE)
    return False


def type_name(tp: Any) -> str:
    """The expected type in words, for error messages."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return "any value"
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if origin is Union:
        text = " or ".join(type_name(a) for a in args if a is not _NONE)
        return text + " or null" if _NONE in args else text
    if origin is list:
        return f"a list of {_plural(args[0])}" if args else "a list"
    if is_mapping_type(tp):
        return "a mapping"
    return {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _plural(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "values from " + ", ".join(str(a) for a in get_args(tp))
    name = type_name(tp)
    return {"a boolean (true/false)": "booleans", "an integer": "integers", "a number": "numbers",
            "a string": "strings"}.get(name, f"({name})")


_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def coerce(value: Any, tp: Any, *, allow_interpolation: bool = False) -> Any:
    """Convert a value read from YAML (or parsed from the command line) to `tp`; raise CoerceError otherwise.

    Conversions are the lossless ones a user means: "1e-6" to a float (PyYAML reads it as a string), "true" to a
    bool, 3 to 3.0, 1000.0 to 1000, a number to a string field, a single value to a one-item list.
    """
    if allow_interpolation and isinstance(value, str) and "${" in value:
        return value  # resolved after all sources are merged
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return value
    if origin is Union:
        if value is None:
            if _NONE in args:
                return None
            raise CoerceError(type_name(tp))
        # Try exact matches first so that e.g. Union[str, list[str]] keeps a list a list.
        for arg in sorted((a for a in args if a is not _NONE), key=lambda a: not check_type(value, a)):
            try:
                return coerce(value, arg)
            except CoerceError:
                continue
        raise CoerceError(type_name(tp))
    if value is None:
        raise CoerceError(type_name(tp))
    if origin is Literal:
        if value in args and type(value) is type(next(a for a in args if a == value)):
            return value
        raise CoerceError(type_name(tp))
    if origin is list:
        items = value if isinstance(value, (list, tuple)) else [value]
        out = []
        for v in items:
            try:
                out.append(coerce(v, args[0] if args else Any))
            except CoerceError as e:
                raise CoerceError(f"{type_name(tp)} ({v!r} is not {e})") from None
        return out
    if is_mapping_type(tp):
        if isinstance(value, dict):
            return dict(value)
        raise CoerceError(type_name(tp))
    if tp is bool:
        return _to_bool(value)
    if tp is int:
        return _to_int(value)
    if tp is float:
        return _to_float(value)
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise CoerceError(type_name(tp))
    raise CoerceError(type_name(tp))


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise CoerceError(type_name(bool))


def _to_int(value: Any) -> int:
    if isinstance(value, bool):
        raise CoerceError(type_name(int))
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip().replace("_", ""))
        except ValueError:
            try:
                value = float(value)
            except ValueError:
                raise CoerceError(type_name(int)) from None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise CoerceError(type_name(int))


def _to_float(value: Any) -> float:
    if isinstance(value, bool):
        raise CoerceError(type_name(float))
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            pass
    raise CoerceError(type_name(float))


def check_type(value: Any, tp: Any) -> bool:
    """Whether `value` already is of type `tp` (no conversion): used to validate a tree built in code."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return True
    if origin is Union:
        return any(check_type(value, a) for a in args)
    if tp is _NONE:
        return value is None
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if origin is list:
        return isinstance(value, list) and all(check_type(v, args[0] if args else Any) for v in value)
    if is_mapping_type(tp):
        return isinstance(value, dict)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if is_group(tp):
        return isinstance(value, tp)
    return isinstance(value, tp)


def iter_leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any, Any, Any]]:
    """Yield (dotted key, value, annotated type, owning dataclass instance) for every non-group field."""
    for f in dataclasses.fields(obj):
        key = f"{prefix}{f.name}"
        tp = hints(type(obj))[f.name]
        value = getattr(obj, f.name)
        if is_group(tp) and isinstance(value, tp):
            yield from iter_leaves(value, key + ".")
        else:
            yield key, value, tp, obj


@functools.cache
def all_keys(cls: type, prefix: str = "") -> tuple[str, ...]:
    """Every dotted key under `cls`, groups included, in declaration order."""
    out: list[str] = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        out.append(key)
        tp = hints(cls)[f.name]
        if is_group(tp):
            out.extend(all_keys(tp, key + "."))
    return tuple(out)


def field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]
