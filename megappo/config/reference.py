"""The configuration reference, `docs/configuration.md`, generated from the config tree (`MegappoConfig`).

Every key of the tree as a dotted path, with its type, its default and its description: the comment on the field's
line and the comment lines right above it, read from the schema's source (`ast` and `tokenize`), and each section's
dataclass docstring. The page is generated, never edited; `tests/unit/test_config_reference.py` fails when it and
the schema differ.

    python -m megappo.config.reference > docs/configuration.md      # regenerate
    python -m megappo.config.reference --check docs/configuration.md   # exit 1 when it is stale

Standard library and `megappo.config` only, like the rest of the package.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import io
import json
import re
import sys
import tokenize
import typing
from typing import Any, Iterator, Literal, Union, get_args, get_origin

from megappo.config.fields import hints, is_group
from megappo.config.schema import MegappoConfig

REGENERATE = "python -m megappo.config.reference > docs/configuration.md"
_NONE = type(None)

HEADER = f"""# Configuration reference

<!-- Generated from megappo/config/schema/ by `{REGENERATE}`; do not edit. -->

Every key megappo reads, as a dotted path (`key=value` on the command line, or nested in a recipe's YAML), with its
type, its default and what the schema's source says of it (the comment on the field's line and the comment lines
above it; a comment above a run of fields is shown with the first of them). A default of `null` marked "resolved"
is filled from another key by `megappo.config.derived.resolve`. How recipes and overrides are read and checked:
[Training, Configuration](training.md#configuration).

This page is generated from the config dataclasses (`megappo/config/schema/`, root `MegappoConfig`); regenerate
it with `{REGENERATE}` (`tests/unit/test_config_reference.py` fails when it is stale).
"""


@dataclasses.dataclass(frozen=True)
class Key:
    """One leaf of the tree."""

    path: str
    type: str
    default: str
    doc: str


@dataclasses.dataclass(frozen=True)
class Section:
    """One group (dataclass) of the tree, at its dotted path, with its leaves."""

    path: str
    doc: str  # the group field's own comment, then the dataclass docstring
    keys: tuple[Key, ...]


@functools.cache
def _source(module_name: str) -> tuple[list[str], dict[int, str], ast.Module]:
    """(lines, {line: the comment after code on it}, tree) of a module's source."""
    text = inspect.getsource(sys.modules[module_name])
    lines = text.splitlines()
    trailing = {}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            if lines[row - 1][:col].strip():
                trailing[row] = tok.string
    return lines, trailing, ast.parse(text)


def _class_node(cls: type) -> ast.ClassDef:
    _, _, tree = _source(cls.__module__)
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)


def _strip(comment: str) -> str:
    return comment.strip().removeprefix("#").strip()


@functools.cache
def field_comments(cls: type) -> dict[str, str]:
    """{field: its comment}: the full-line comments right above the field (no blank line between), then the
    comment after its code."""
    lines, trailing, _ = _source(cls.__module__)
    out = {}
    for stmt in _class_node(cls).body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above, row = [], stmt.lineno - 1
        while row >= 1 and lines[row - 1].strip().startswith("#"):
            above.insert(0, _strip(lines[row - 1]))
            row -= 1
        after = [_strip(trailing[r]) for r in range(stmt.lineno, stmt.end_lineno + 1) if r in trailing]
        out[stmt.target.id] = " ".join(part for part in (*above, *after) if part)
    return out


def class_doc(cls: type) -> str:
    """The dataclass's own docstring (not the signature `dataclass` writes when there is none)."""
    return ast.get_docstring(_class_node(cls)) or ""


def type_text(tp: Any) -> str:
    """A resolved annotation as the schema writes it (aliases such as `DType` expanded to their Literal)."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return "Any"
    if tp is _NONE:
        return "None"
    if origin is Literal:
        return "Literal[" + ", ".join(json.dumps(a) for a in args) + "]"
    if origin is Union:
        rest = [a for a in args if a is not _NONE]
        if len(rest) == 1 and len(args) == 2:
            return f"Optional[{type_text(rest[0])}]"
        return "Union[" + ", ".join(type_text(a) for a in args) + "]"
    if origin in (list, dict):
        return f"{origin.__name__}[" + ", ".join(type_text(a) for a in args) + "]"
    return getattr(tp, "__name__", str(tp))


def default_text(value: Any) -> str:
    """A default as YAML reads it (JSON, a subset of YAML)."""
    return json.dumps(value, ensure_ascii=False)


def sections(root: Any = None, path: str = "", doc: str = "") -> Iterator[Section]:
    """The tree's groups depth-first in declaration order, each with its leaves; defaults are the root instance's
    (so a group built by its own factory, such as `critic.optim`, shows its own)."""
    root = MegappoConfig() if root is None else root
    cls, groups, keys = type(root), [], []
    comments = field_comments(cls)
    for f in dataclasses.fields(root):
        tp, value, key = hints(cls)[f.name], getattr(root, f.name), f"{path}{f.name}"
        if is_group(tp) and isinstance(value, tp):
            groups.append((value, key, comments[f.name]))
        else:
            keys.append(Key(key, type_text(tp), default_text(value), comments[f.name]))
    own = "\n\n".join(part for part in (doc, class_doc(cls)) if part)
    yield Section(path.rstrip("."), own, tuple(keys))
    for value, key, comment in groups:
        yield from sections(value, key + ".", comment)


_CODE = re.compile(r"(`[^`]*`)")
_ESCAPES = {"&": "&amp;", "<": "&lt;", ">": "&gt;", "|": "\\|", "*": "\\*", "[": "\\[", "]": "\\]"}
_EDGE_UNDERSCORE = re.compile(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9_])")  # inside a word `_` is no emphasis


def markdown_text(text: str) -> str:
    """Source text as Markdown that renders as written: special characters escaped outside code spans."""
    parts = _CODE.split(text)
    for i in range(0, len(parts), 2):
        parts[i] = _EDGE_UNDERSCORE.sub(r"\\_", "".join(_ESCAPES.get(c, c) for c in parts[i]))
    return "".join(parts)


def _code(text: str) -> str:
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def render() -> str:
    """The whole page."""
    out = [HEADER]
    for s in sections():
        if not s.path:  # the root: groups only
            continue
        out.append(f"## `{s.path}`\n")
        if s.doc:
            out.extend(markdown_text(p.replace("\n", " ")) + "\n" for p in s.doc.split("\n\n"))
        if s.keys:
            out.append("| key | type | default | description |\n| --- | --- | --- | --- |")
            out.extend(f"| {_code(k.path)} | {_code(k.type)} | {_code(k.default)} | {markdown_text(k.doc)} |"
                       for k in s.keys)
            out.append("")
    return "\n".join(out)


def main(argv: typing.Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megappo.config.reference", description=__doc__.splitlines()[0])
    parser.add_argument("--check", metavar="PATH", help="exit 1 when PATH is not the generated page")
    args = parser.parse_args(argv)
    text = render()
    if args.check is None:
        sys.stdout.write(text)
        return 0
    with open(args.check, encoding="utf-8") as f:
        if f.read() == text:
            return 0
    print(f"{args.check} is not the configuration reference the schema generates; regenerate it: {REGENERATE}",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
