"""The code's layout, measured from its source (AST only, nothing imported): the import graph between megappo's
files (function-local imports included) and its cycles, the layering rules, file and function lengths, and each
capability's branch points outside its own home.

A branch point is a test of an `if`/`elif`/`while`, a conditional expression or a comprehension's `if` that names
the capability (an identifier, attribute, keyword or string matching its pattern). A capability with one home is
asked, not tested for: its branch points gather in its own files.

    python -m megappo.testing.structure        # the report; tests/unit/test_structure.py holds the bounds
"""
from __future__ import annotations

import ast
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]  # megappo/
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80

# capability -> (what names it, its homes: files or folders relative to megappo/, where testing for it is its job)
CAPABILITIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "vlm": (r"vlm|vision|multi_?modal|image|pixel|qwen2_vl|visual|mrope|rope_deltas",
            ("kinds/qwen2_vl/",
             "data/multimodal.py", "data/images.py", "data/geo3k.py", "rollout/sglang/cpu_vlm.py",
             "rollout/sglang/vlm.py", "rollout/hf/vlm.py",
             "tasks/colour_square.py", "rewards/geo3k.py", "testing/")),
    "lora": (r"lora|adapter|peft", ("models/lora/", "convert/peft_io.py", "testing/")),
    "packing": (r"pack|remove_padding|cu_seqlens", ("models/layout/", "testing/")),
    "context_parallel": (r"context_parallel|\bcp\b|\bcp_|_cp\b", ("models/layout/", "testing/")),
}
BRANCH_BOUNDS = {"vlm": 8, "lora": 6, "packing": 4, "context_parallel": 4}

# (importer prefix, imported prefixes it must not reach), as module names
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("megappo.rollout", ("megappo.config", "megappo.trainer")),
    ("megappo.convert", ("megappo.trainer",)),
    ("megappo.models", ("megappo.convert", "megappo.trainer")),
    ("megappo.kinds", ("megappo.trainer",)),
    ("megappo.algos", ("megappo.config", "megappo.trainer", "megappo.models", "megappo.rollout")),
    ("megappo.trainer.preflight", ("megappo.rollout.sglang",)),
)


def _files() -> dict[str, Path]:
    mods = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imported(node: ast.AST, module: str, is_package: bool, mods: dict[str, Path]) -> list[str]:
    targets = []
    if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            pkg = module.split(".") if is_package else module.split(".")[:-1]
            pkg = pkg[:len(pkg) - node.level + 1]
            base = ".".join(pkg + ([base] if base else []))
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    found = []
    for name in targets:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        if name and name != module and not module.startswith(name + "."):  # a package's own __init__ aside
            found.append(name)
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the megappo modules it imports anywhere in its file (function-local imports included)."""
    mods = _files()
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in mods.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[module].update(_imported(node, module, path.name == "__init__.py", mods))
        graph.setdefault(module, set())
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for importer, banned in LAYERS:
        for module, deps in sorted(graph.items()):
            if module == importer or module.startswith(importer + "."):
                out += [f"{module} -> {d}" for d in sorted(deps) if d.startswith(banned)]
    return out


def long_files() -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        n = path.read_text().count("\n")
        if n > MAX_FILE_LINES:
            out.append(f"{path.relative_to(PACKAGE.parent)}: {n} lines")
    return out


def long_functions() -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    out.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}: {n} lines")
    return out


def _names(node: ast.AST) -> list[str]:
    out = []
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.append(n.id)
        elif isinstance(n, ast.Attribute):
            out.append(n.attr)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            out.append(n.value)
        elif isinstance(n, ast.keyword) and n.arg:
            out.append(n.arg)
    return out


def _tests(tree: ast.AST):
    for n in ast.walk(tree):
        if isinstance(n, (ast.If, ast.While, ast.IfExp)):
            yield n.test
        elif isinstance(n, ast.comprehension):
            yield from n.ifs


def branch_points() -> dict[str, Counter]:
    """capability -> {file: branch points naming it}, outside the capability's homes."""
    out: dict[str, Counter] = {name: Counter() for name in CAPABILITIES}
    patterns = {name: re.compile(rx, re.I) for name, (rx, _) in CAPABILITIES.items()}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text())
        for test in _tests(tree):
            names = _names(test)
            for name, (_, homes) in CAPABILITIES.items():
                if not rel.startswith(homes) and any(patterns[name].search(x) for x in names):
                    out[name][rel] += 1
    return out


def main() -> int:
    graph = import_graph()
    problems = 0
    for title, lines in (("import cycles", [" <-> ".join(c) for c in cycles(graph)]),
                         ("layering", layering_violations(graph)), ("files over 500 lines", long_files()),
                         ("functions over 80 lines", long_functions())):
        print(f"{title}: {len(lines)}")
        print("".join(f"  {line}\n" for line in lines), end="")
        problems += len(lines)
    for name, counts in branch_points().items():
        total = sum(counts.values())
        print(f"{name}: {total} branch points in {len(counts)} files (bound {BRANCH_BOUNDS[name]})")
        print("".join(f"  {n:3d} {f}\n" for f, n in counts.most_common()), end="")
        problems += total > BRANCH_BOUNDS[name]
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
