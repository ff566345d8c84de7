"""The golden-metrics tool's comparison (megappo/testing/golden.py): bit for bit, machine keys left out, and every
kind of difference named (a moved number, a missing or new key, a missing row)."""
from __future__ import annotations

import json
import math

from megappo.testing import golden

ROWS = [{"step": 0, "val/reward_mean": 0.25}, {"step": 1, "reward/mean": 0.5, "actor/pg_loss": -0.0123456789012345}]


def test_the_same_rows_have_no_differences_and_machine_keys_do_not_count():
    got = [dict(r, **{"timing/step_s": 0.3, "perf/tokens_per_s": 1e4}) for r in ROWS]
    assert golden.differences(golden.strip_machine_keys(got), ROWS) == []


def test_one_ulp_a_key_and_a_row_are_each_a_difference():
    ulp = math.nextafter(ROWS[1]["actor/pg_loss"], 0.0)
    moved = [dict(ROWS[0]), dict(ROWS[1], **{"actor/pg_loss": ulp})]
    assert golden.differences(moved, ROWS) == [f"row 1 (step 1): actor/pg_loss = {ulp!r}, golden -0.0123456789012345"]
    assert golden.differences([ROWS[0], {"step": 1, "reward/mean": 0.5}], ROWS) == [
        "row 1 (step 1): missing ['actor/pg_loss']"]
    assert golden.differences([ROWS[0], dict(ROWS[1], **{"x/new": 1.0})], ROWS) == ["row 1 (step 1): new keys ['x/new']"]
    assert golden.differences(ROWS[:1], ROWS)[0].startswith("1 rows, the golden has 2")
    assert golden.differences([ROWS[0], dict(ROWS[1], **{"reward/mean": 1})], [ROWS[0], dict(ROWS[1], **{
        "reward/mean": 1.0})])  # an int where a float was logged is a change of type


def test_a_written_golden_reads_back_with_its_header(tmp_path):
    golden.write("tiny_ppo", ROWS, tmp_path)
    header, rows = golden.read("tiny_ppo", tmp_path)
    assert rows == ROWS and header["recipe"] == "recipes/cpu/tiny_ppo.yaml"
    assert header["env"] == golden.GOLDEN_ENV and header["cpu"] == golden.cpu_signature()
    assert all(json.loads(line) for line in (tmp_path / "tiny_ppo.jsonl").read_text().splitlines())


def test_every_cpu_recipe_has_a_golden():
    """A recipe added to recipes/cpu gets its golden in the same commit (`python tools/golden.py record NAME`)."""
    missing = [name for name in golden.RUNS if not golden.path_of(name).exists()]
    assert not missing, missing


def test_an_asynchronous_schedule_that_moved_is_told_apart_from_a_number_that_moved():
    """A weight sync that lands while a generation runs (a busy machine) aborts it: the first row that differs says
    so in its async/ keys, and the comparison names the timing instead of calling it a change of the code."""
    want = [{"step": 1, "async/partial_fraction": 0.0, "reward/mean": 0.5}, {"step": 2, "reward/mean": 0.6}]
    timed = [{"step": 1, "async/partial_fraction": 0.015625, "reward/mean": 0.25}, {"step": 2, "reward/mean": 0.7}]
    assert golden.schedule_timing(timed, want) == "step 1: async/partial_fraction = 0.015625, golden 0.0"
    moved = [{"step": 1, "async/partial_fraction": 0.0, "reward/mean": 0.25}, want[1]]
    assert golden.schedule_timing(moved, want) == ""
    assert golden.Outcome("x", ["d"], schedule="step 1").ok and not golden.Outcome("x", ["d"]).ok
