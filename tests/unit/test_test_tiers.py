"""The fast tier stays fast: every test in tests/unit that starts ranks is marked `multirank`, so
`pytest -m "not multirank"` starts no subprocess ranks (a world of one in a spawned process is not ranks)."""
from __future__ import annotations

import ast
from pathlib import Path

UNIT = Path(__file__).resolve().parent
# what starts ranks: the test launcher, torch's spawners, torchrun (as a command or the launch script)
STARTERS = {"run_distributed", "spawn", "start_processes"}


def _one_process(call: ast.Call) -> bool:
    """run_distributed(fn, 1, ...): a single spawned process (isolation from process-global state), not ranks."""
    size = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "world_size"), None)
    return isinstance(size, ast.Constant) and size.value == 1


def _starts_ranks(node: ast.AST, helpers: set[str]) -> bool:
    single = {id(c.func) for c in ast.walk(node) if isinstance(c, ast.Call) and _one_process(c)
              and ast.unparse(c.func).split(".")[-1] == "run_distributed"}
    for sub in ast.walk(node):
        if id(sub) in single:
            continue
        if isinstance(sub, ast.Name) and sub.id in STARTERS | helpers:
            return True
        if isinstance(sub, ast.Attribute) and sub.attr in STARTERS | helpers:
            return True
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and (
                sub.value == "torchrun" or sub.value.endswith("torchrun.sh")):
            return True
    return False


def _marked(decorators: list[ast.expr]) -> bool:
    return any("multirank" in ast.unparse(d) for d in decorators)


def test_tests_that_start_ranks_are_marked_multirank():
    unmarked = []
    for path in sorted(UNIT.glob("test_*.py")):
        if path.name == Path(__file__).name:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        module_marked = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                            and "multirank" in ast.unparse(n.value) for n in tree.body)
        functions = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        helpers: set[str] = set()
        for _ in range(3):  # helpers that call helpers that start ranks
            helpers |= {f.name for f in functions if not f.name.startswith("test_") and _starts_ranks(f, helpers)}
        for f in functions:
            tests = [f] if f.name.startswith("test_") else [m for m in getattr(f, "body", [])
                                                               if isinstance(m, ast.FunctionDef)
                                                               and m.name.startswith("test_")]
            for t in tests:
                if _starts_ranks(t, helpers) and not (module_marked or _marked(f.decorator_list)
                                                      or _marked(t.decorator_list)):
                    unmarked.append(f"{path.name}::{t.name}")
    assert not unmarked, f"these start ranks: mark them @pytest.mark.multirank (or move them): {unmarked}"
