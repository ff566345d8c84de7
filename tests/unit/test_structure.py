"""The code's structure holds (megappo/testing/structure.py measures it from the source): no import cycle between
files (function-local imports included), the layering rules, files under 500 lines and functions under 80, and
each capability asked of its own object rather than tested for in other files (at most a few branch points
outside its home), no rule's message written in two places, and the packages' layers: PACKAGE_ORDER names every top-level package, only tests import
`megappo.testing`, and the package loops and the imports that reach up the order do not grow."""
from __future__ import annotations

import warnings

import pytest

from megappo.testing import structure


@pytest.fixture(scope="module")
def graph():
    return structure.import_graph()


def test_no_import_cycles(graph):
    assert structure.cycles(graph) == []


def test_layering(graph):
    """Engines import nothing from the config tree or the trainer, conversion nothing from the trainer, models
    nothing from conversion, the trainer's preflight no SGLang module."""
    assert structure.layering_violations(graph) == []


def test_files_and_functions_are_short():
    assert structure.long_files() == []
    assert structure.long_functions() == []
    near = structure.long_files(structure.WARN_FILE_LINES)
    if near:  # not a failure: a file near its bound is split where a concept ends, not to pass the bound
        warnings.warn(f"files over {structure.WARN_FILE_LINES} lines: {near}")


@pytest.mark.parametrize("capability", sorted(structure.BRANCH_BOUNDS))
def test_each_capability_is_asked_not_tested_for(capability):
    counts = structure.branch_points()[capability]
    assert sum(counts.values()) <= structure.BRANCH_BOUNDS[capability], dict(counts)


def test_no_rule_is_written_twice():
    assert structure.repeated_messages() == {}


def test_a_message_written_twice_is_found(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text('def f(x):\n    raise ValueError(f"model.path {x} has no config.json; point it at a model")\n')
    b.write_text('def g(errors, y):\n    errors.append(f"model.path {y} has no config.json; point it elsewhere")\n'
                 '    raise KeyError(f"{y}: {y}")  # too little text to name a rule\n')
    found = structure.repeated_messages([a, b])
    assert list(found) == ["model.path {} has no config.json; point "]
    assert [w.rsplit(":", 1)[1] for w in found["model.path {} has no config.json; point "]] == ["2", "2"]


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert structure.cycles(graph) == [["a", "b", "c"]]


@pytest.fixture(scope="module")
def packages():
    return structure.package_graph()


def test_package_order_names_every_top_level_package():
    named = [n for level in structure.PACKAGE_ORDER for n in (level if isinstance(level, tuple) else (level,))]
    assert len(named) == len(set(named)), named
    assert set(named) | set(structure.OUTSIDE_ORDER) == structure.top_level()


def test_package_cycles_do_not_grow(packages):
    """Loops between top-level packages are being cut: there are no more of them, and no more packages in them,
    than the bounds (lowered as they go)."""
    loops = structure.package_cycles(packages)
    closing = [e for _, edges in loops for e in edges]
    assert len(loops) <= structure.LAYER_BOUNDS["package cycles"], closing
    assert sum(len(c) for c, _ in loops) <= structure.LAYER_BOUNDS["packages in cycles"], [c for c, _ in loops]


def test_upward_imports_do_not_grow(packages):
    """A package imports only those below it in PACKAGE_ORDER (function-local imports and module strings
    included); the ones that still reach up are bounded."""
    upward = structure.upward_imports(packages)
    assert len(upward) <= structure.LAYER_BOUNDS["upward imports"], "\n".join(upward)


def test_only_tests_import_testing(packages):
    assert structure.testing_importers(packages) == []


def test_an_import_up_the_order_is_found_and_a_module_string_counts():
    packages = structure.package_graph({"megappo.platform.a": {"megappo.rollout.b"}, "megappo.rollout.b": set(),
                                        "megappo.trainer.c": {"megappo.platform.a"}})
    assert structure.upward_imports(packages) == ["megappo.platform.a -> megappo.rollout.b"]
    graph = structure.import_graph(strings=True)
    assert "megappo.rollout.hf.deploy" in graph["megappo.rollout.registry"]  # "megappo.rollout.hf.deploy:deploy"
    assert "megappo.rollout.hf.deploy" not in structure.import_graph()["megappo.rollout.registry"]


def test_text_families_are_told_apart_only_by_their_table():
    """The config reader, the conversion and the export read `megappo.models.families.FAMILIES`; no other module
    compares a `family` against a family's name."""
    assert structure.family_tests() == []


def test_a_family_test_is_found():
    import ast

    tree = ast.parse('if spec.family == "mixtral":\n    pass\nok = family in ("qwen3", "qwen3_moe")\n'
                     'fine = family in FAMILIES\n')
    assert structure.family_tests_in(tree) == [1, 3]


def test_only_kinds_import_a_kind():
    """Outside `megappo.kinds` (and the test helpers) code asks the kind object, never imports a kind's modules."""
    assert structure.kind_imports() == []


def test_a_kind_import_is_found():
    graph = {"megappo.models.compute": {"megappo.kinds.qwen2_vl.inputs", "megappo.kinds"},
             "megappo.kinds.qwen2_vl.model": {"megappo.kinds.qwen2_vl.inputs"},
             "megappo.testing.vlm_models": {"megappo.kinds.qwen2_vl.verify"}}
    assert structure.kind_imports(graph) == ["megappo.models.compute -> megappo.kinds.qwen2_vl.inputs"]


def test_a_front_door_import_is_no_kind_import():
    """The modules directly in megappo/kinds/ ask the kind for everyone: importing them is asking the kind."""
    graph = {"megappo.trainer.roles": {"megappo.kinds.build", "megappo.kinds.weights"}}
    assert structure.kind_imports(graph) == []
