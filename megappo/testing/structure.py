"""The code's layout, measured from its source (AST only, nothing imported): the import graph between megappo's
files (function-local imports included) and its cycles, the layering rules, file and function lengths, and each
capability's branch points outside its own home.

The package view: the top-level packages in their declared order (PACKAGE_ORDER, bottom to top), the loops between
them and every file-level import that reaches up the order. There a string constant naming a megappo module
("megappo.x.y", "megappo.x.y:attr", an `-m` entry point) counts as an import: registries import what they name.

A message written twice is a rule written twice: the literal start (MESSAGE_PREFIX characters, each formatted value
read as "{}") of every exception raised with a message and every message appended to an `errors` list must occur in
one place only; a rule stated twice is a function both places ask.

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
WARN_FILE_LINES = 450  # past it a file is near its bound: split it where a concept ends, before a change forces it
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
MESSAGE_PREFIX = 40  # characters of a message's literal start that name it
MESSAGE_MIN_LITERAL = 25  # a start with fewer literal characters ("{}: {}") names no rule
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

# megappo's top-level packages and modules, bottom to top: each may import only those on its own level (a tuple) or
# below. `testing` stands outside: it may import anything, and only tests import it. The config tree stands above
# the engines, models and algorithms: they take plain settings built from it (LAYERS). Each capability's config
# rules live beside it (`checks.py`) and read the tree without importing it; `checks`, the one table of them, stands
# above every capability it asks.
PACKAGE_ORDER: tuple[str | tuple[str, ...], ...] = (
    "platform", "chat", "sandbox", "parallel", "algos", "data", "models", "convert", "kinds", "tasks", "rollout",
    "config", "rewards", "envs", ("multi_turn", "agents"), "distill", "checks", "trainer",
    ("train_cli", "rollout_server_cli", "convert_cli"), "cli",
)
OUTSIDE_ORDER = ("testing",)
# held at 0: package loops, packages caught in them, imports that go up PACKAGE_ORDER
LAYER_BOUNDS = {"package cycles": 0, "packages in cycles": 0, "upward imports": 0}


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


_MODULE_STRING = re.compile(r"megappo(\.\w+)+(:[\w.]+)?")


def _named_module(text: str, mods: dict[str, Path]) -> str | None:
    """The megappo module a "megappo.a.b", "megappo.a.b:attr" or "megappo.a.b.attr" string names, if it is one."""
    if not _MODULE_STRING.fullmatch(text):
        return None
    name = text.partition(":")[0]
    if name not in mods and ":" not in text:
        name = name.rpartition(".")[0]
    return name if name in mods else None


def _string_value(node: ast.AST, consts: dict[str, str]) -> str | None:
    """A string constant, or an f-string built only of literals and module-level string constants."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = [_string_value(v.value if isinstance(v, ast.FormattedValue) else v, consts) for v in node.values]
        return None if None in parts else "".join(parts)
    if isinstance(node, ast.Name):
        return consts.get(node.id)
    return None


def _named_in_strings(tree: ast.Module, module: str, mods: dict[str, Path]) -> set[str]:
    """Modules named by strings: registries ("module:attr") and `-m module` entry points import them lazily."""
    consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
              if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)}
    found: set[str] = set()
    if module == __name__:  # its tables name modules as rules, not to load them
        return found
    for node in ast.walk(tree):
        if isinstance(node, (ast.Constant, ast.JoinedStr)):
            text = _string_value(node, consts)
            name = _named_module(text, mods) if text else None
            if name and name != module and not module.startswith(name + "."):
                found.add(name)
    return found


def import_graph(strings: bool = False) -> dict[str, set[str]]:
    """module -> the megappo modules it imports anywhere in its file (function-local imports included), and with
    `strings` those its string constants name."""
    mods = _files()
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in mods.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[module].update(_imported(node, module, path.name == "__init__.py", mods))
        if strings:
            graph[module].update(_named_in_strings(tree, module, mods))
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


def top_level() -> set[str]:
    """megappo's top-level packages and modules."""
    return {p.stem for p in PACKAGE.iterdir()
            if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph(graph: dict[str, set[str]] | None = None) -> dict[str, dict[str, list[str]]]:
    """package -> {package it imports: its file-level edges "importer -> imported"}, module strings included."""
    graph = import_graph(strings=True) if graph is None else graph
    out: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for module, deps in sorted(graph.items()):
        for dep in sorted(deps):
            if _top(module) != _top(dep):
                out[_top(module)][_top(dep)].append(f"{module} -> {dep}")
    return {pkg: dict(deps) for pkg, deps in out.items()}


def _levels() -> dict[str, int]:
    return {name: i for i, level in enumerate(PACKAGE_ORDER)
            for name in (level if isinstance(level, tuple) else (level,))}


def package_cycles(packages: dict[str, dict[str, list[str]]]) -> list[tuple[list[str], list[str]]]:
    """Each loop between packages: its packages and the file-level edges that close it (those not going down
    PACKAGE_ORDER; a loop is cut by removing them)."""
    level = _levels()
    found = cycles({pkg: set(deps) for pkg, deps in packages.items()})
    return [(comp, [e for a in comp for b in comp if b in packages.get(a, {})
                    and level.get(b, len(level)) >= level.get(a, len(level)) for e in packages[a][b]])
            for comp in found]


def upward_imports(packages: dict[str, dict[str, list[str]]]) -> list[str]:
    """The file-level edges whose target package stands above the importer's in PACKAGE_ORDER."""
    level = _levels()
    return [e for a, deps in sorted(packages.items()) for b, edges in sorted(deps.items())
            if a in level and b in level and level[b] > level[a] for e in edges]


def testing_importers(packages: dict[str, dict[str, list[str]]]) -> list[str]:
    """Edges into `testing` from the package itself: only tests may use it."""
    return [e for a, deps in sorted(packages.items()) if a not in OUTSIDE_ORDER
            for b in OUTSIDE_ORDER for e in deps.get(b, [])]


def long_files(limit: int = MAX_FILE_LINES) -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        n = path.read_text().count("\n")
        if n > limit:
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


def kind_imports(graph: dict[str, set[str]] | None = None) -> list[str]:
    """Imports of a model kind's own modules (`megappo.kinds.<kind>...`, module strings included) from outside
    `megappo.kinds`: the rest asks the kind object (`megappo.kinds.kind_of`) or the front doors that ask it (the
    modules directly in `megappo/kinds/`). `testing` stands outside the order."""
    graph = import_graph(strings=True) if graph is None else graph
    inside = ("megappo.kinds",) + tuple(f"megappo.{p}" for p in OUTSIDE_ORDER)
    kinds = {p.name for p in (PACKAGE / "kinds").iterdir() if p.is_dir() and any(p.glob("*.py"))}  # kind folders
    return [f"{m} -> {d}" for m, deps in sorted(graph.items()) if not (m in inside or m.startswith(
        tuple(f"{p}." for p in inside))) for d in sorted(deps) if d.startswith("megappo.kinds.") and d.split(".")[2]
            in kinds]


# the one module that may tell the text families apart by name: everything else reads its table
FAMILY_TABLE = "models/families.py"


def _is_family(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "family") or (
        isinstance(node, ast.Attribute) and node.attr == "family")


def _is_strings(node: ast.AST) -> bool:
    """A string constant, or a tuple, list or set of them."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(_is_strings(e) and not isinstance(e, (ast.Tuple, ast.List, ast.Set))
                                       for e in node.elts)
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def family_tests_in(tree: ast.AST) -> list[int]:
    """Lines of comparisons of a `family` name or `.family` attribute against a string or strings."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_is_family(a) and _is_strings(b) or _is_strings(a) and _is_family(b)
                   for a, b in zip(operands, operands[1:])):
                lines.append(node.lineno)
    return lines


def family_tests() -> list[str]:
    """`family == "..."` tests outside the family table (megappo.models.families)."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel != FAMILY_TABLE:
            out += [f"{path.relative_to(PACKAGE.parent)}:{n}" for n in family_tests_in(ast.parse(path.read_text()))]
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


def _template(node: ast.AST) -> str | None:
    """A message's text with each formatted value as "{}" (a constant, an f-string, or a sum of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _template(node.left), _template(node.right)
        return None if left is None else left + ("{}" if right is None else right)
    return None


def _messages(tree: ast.AST):
    """(line, text) of each exception raised with a message and each message appended to an `errors` list."""
    for n in ast.walk(tree):
        arg = None
        if isinstance(n, ast.Raise) and isinstance(n.exc, ast.Call) and n.exc.args:
            f = n.exc.func
            if (f.id if isinstance(f, ast.Name) else getattr(f, "attr", "")).endswith(("Error", "Exception")):
                arg = n.exc.args[0]
        elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "append"
              and isinstance(n.func.value, ast.Name) and "error" in n.func.value.id and n.args):
            arg = n.args[0]
        text = None if arg is None else _template(arg)
        if text is not None:
            yield n.lineno, text


def repeated_messages(files: list[Path] | None = None) -> dict[str, list[str]]:
    """A message's literal start -> its places ("file:line"), for each start written in more than one place."""
    places: dict[str, list[str]] = defaultdict(list)
    for path in files if files is not None else sorted(PACKAGE.rglob("*.py")):
        for line, text in _messages(ast.parse(path.read_text())):
            start = " ".join(text.split())[:MESSAGE_PREFIX]
            if len(start.replace("{}", "")) >= MESSAGE_MIN_LITERAL:
                where = path.relative_to(PACKAGE.parent) if path.is_relative_to(PACKAGE.parent) else path
                places[start].append(f"{where}:{line}")
    return {start: where for start, where in places.items() if len(where) > 1}


def _package_report() -> int:
    """Print the package view; the number of its bounds exceeded."""
    packages = package_graph()
    loops = package_cycles(packages)
    counts = {"package cycles": len(loops), "packages in cycles": sum(len(c) for c, _ in loops)}
    print(f"package cycles: {len(loops)} over {counts['packages in cycles']} packages "
          f"(bounds {LAYER_BOUNDS['package cycles']}, {LAYER_BOUNDS['packages in cycles']})")
    upward, testing = upward_imports(packages), testing_importers(packages)
    for comp, edges in loops:  # the upward imports among them are listed below; the others are between equals
        level = [e for e in edges if e not in upward]
        print(f"  {' <-> '.join(comp)}, closed by {len(edges)} edges ({len(level)} on one level)")
        print("".join(f"    {e}\n" for e in level), end="")
    counts["upward imports"] = len(upward)
    for title, lines in ((f"upward imports (bound {LAYER_BOUNDS['upward imports']})", upward),
                         ("imports of testing", testing)):
        print(f"{title}: {len(lines)}")
        print("".join(f"  {line}\n" for line in lines), end="")
    return sum(counts[k] > LAYER_BOUNDS[k] for k in LAYER_BOUNDS) + len(testing)


def main() -> int:
    graph = import_graph()
    problems = _package_report()
    for title, lines in (("import cycles", [" <-> ".join(c) for c in cycles(graph)]),
                         ("layering", layering_violations(graph)), ("files over 500 lines", long_files()),
                         ("family tests outside the family table", family_tests()),
                         ("kind imports outside kinds", kind_imports()),
                         ("functions over 80 lines", long_functions()),
                         ("messages written twice", [f"{start!r}: {', '.join(where)}"
                                                     for start, where in repeated_messages().items()])):
        print(f"{title}: {len(lines)}")
        print("".join(f"  {line}\n" for line in lines), end="")
        problems += len(lines)
    for name, counts in branch_points().items():
        total = sum(counts.values())
        print(f"{name}: {total} branch points in {len(counts)} files (bound {BRANCH_BOUNDS[name]})")
        print("".join(f"  {n:3d} {f}\n" for f, n in counts.most_common()), end="")
        problems += total > BRANCH_BOUNDS[name]
    near = [line for line in long_files(WARN_FILE_LINES) if line not in long_files()]
    print(f"files over {WARN_FILE_LINES} lines (a warning): {len(near)}")
    print("".join(f"  {line}\n" for line in near), end="")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
