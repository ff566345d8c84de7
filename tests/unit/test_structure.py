"""The code's structure holds (megappo/testing/structure.py measures it from the source): no import cycle between
files (function-local imports included), the layering rules, files under 500 lines and functions under 80, and
each capability asked of its own object rather than tested for in other files (at most a few branch points
outside its home)."""
from __future__ import annotations

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


@pytest.mark.parametrize("capability", sorted(structure.BRANCH_BOUNDS))
def test_each_capability_is_asked_not_tested_for(capability):
    counts = structure.branch_points()[capability]
    assert sum(counts.values()) <= structure.BRANCH_BOUNDS[capability], dict(counts)


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert structure.cycles(graph) == [["a", "b", "c"]]
