"""The metrics logger around a KL-guard rollback, without a trainer: undone attempts are marked in metrics.jsonl,
read_steps gives one row per step (the last logged), and TensorBoard's main run holds one point per step while
the undone attempts go to tensorboard/rolled_back/ (read back with TensorBoard's own EventAccumulator). The e2e
check on a real rolled-back run is tests/e2e/test_guard.py."""
from __future__ import annotations

import json

from megappo.trainer.metrics import MetricsLogger, one_per_step, read_rows, read_steps


def _points(logdir, tag="reward/mean") -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return [(e.step, round(e.value, 6)) for e in acc.Scalars(tag)]


def _logger(out, **kw) -> MetricsLogger:
    return MetricsLogger(str(out), ["tensorboard"], total_steps=4, enabled=True, **kw)


def test_a_rollback_over_two_steps_leaves_one_point_per_step(tmp_path):
    log = _logger(tmp_path)
    for step in (1, 2, 3):
        log.log(step, {"reward/mean": step / 10})
    log.log(4, {"reward/mean": 0.9}, rolled_back=True)  # step 4 trips; the last checkpoint is step 2's
    log.rolled_back_to(2)
    for step in (3, 4):
        log.log(step, {"reward/mean": step / 10 + 0.05})
    log.close()

    rows = read_rows(str(tmp_path))
    assert [(r["step"], r.get("guard/rolled_back")) for r in rows] == [
        (1, None), (2, None), (3, 1.0), (4, 1.0), (3, None), (4, None)]
    assert [(r["step"], r["reward/mean"]) for r in read_steps(str(tmp_path))] == [
        (1, 0.1), (2, 0.2), (3, 0.35), (4, 0.45)]
    assert _points(tmp_path / "tensorboard") == [(1, 0.1), (2, 0.2), (3, 0.35), (4, 0.45)]
    assert _points(tmp_path / "tensorboard" / "rolled_back") == [(3, 0.3), (4, 0.9)]


def test_a_resume_keeps_the_undone_attempts_up_to_its_checkpoint(tmp_path):
    log = _logger(tmp_path)
    log.log(1, {"reward/mean": 0.1})
    log.log(2, {"reward/mean": 0.9}, rolled_back=True)
    log.rolled_back_to(1)
    log.log(2, {"reward/mean": 0.2})
    log.log(3, {"reward/mean": 0.3})  # then killed; the last checkpoint is step 2's
    log.close()

    again = _logger(tmp_path, start_step=2, resumed=True)
    again.log(3, {"reward/mean": 0.35})
    again.close()
    assert [r["step"] for r in read_rows(str(tmp_path))] == [1, 2, 2, 3]
    assert [r["reward/mean"] for r in read_steps(str(tmp_path))] == [0.1, 0.2, 0.35]
    assert _points(tmp_path / "tensorboard") == [(1, 0.1), (2, 0.2), (3, 0.35)]
    assert _points(tmp_path / "tensorboard" / "rolled_back") == [(2, 0.9)]


def test_one_per_step_takes_each_steps_last_row():
    rows = [{"step": 0, "v": 0}, {"step": 1, "v": 1}, {"step": 2, "v": 2}, {"step": 1, "v": 3}, {"step": 2, "v": 4}]
    assert one_per_step(rows) == [{"step": 0, "v": 0}, {"step": 1, "v": 3}, {"step": 2, "v": 4}]


def test_a_line_cut_short_is_left_out(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "v": 1.0}) + '\n{"step": 2, "v"')
    assert read_steps(str(tmp_path)) == [{"step": 1, "v": 1.0}]
    assert read_steps(str(tmp_path / "nothing")) == []


def test_a_disabled_logger_writes_nothing(tmp_path):  # every rank but global rank 0
    log = MetricsLogger(str(tmp_path / "off"), ["tensorboard"], total_steps=1, enabled=False)
    log.log(1, {"x": 1.0}, rolled_back=True)
    log.rolled_back_to(0)
    log.close()
    assert not (tmp_path / "off").exists()
