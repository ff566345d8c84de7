"""What runs inside a reward worker: call the reward function on one sample and turn its return into plain numbers.

Kept free of torch so a worker process starts in a fraction of a second.
"""
from __future__ import annotations

import math
import numbers
import sys
from typing import Any, Callable, NamedTuple

from megappo.platform.child_process import enter_child


class Outcome(NamedTuple):
    """One sample's result, small enough to send over a pipe."""

    ok: bool  # False: the function raised or returned something that is not a score
    score: float  # meaningful only when ok
    extras: dict[str, float]  # the numeric entries of a returned dict other than "score"
    error: str | None  # why not ok


def _as_number(value: Any) -> float | None:
    if isinstance(value, numbers.Real):  # int, float, bool, numpy scalars
        return float(value)
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # 0-d numpy array / torch tensor
        item = value.item()
        return float(item) if isinstance(item, numbers.Real) else None
    return None


def normalise(result: Any) -> Outcome:
    """float | dict with "score" -> Outcome; anything else, or a non-finite score, is a failure."""
    extras: dict[str, float] = {}
    if isinstance(result, dict):
        if "score" not in result:
            return Outcome(False, 0.0, {}, f"returned a dict without 'score' (keys: {sorted(result)[:8]})")
        raw = result["score"]
        for key, value in result.items():
            number = _as_number(value) if key != "score" else None
            if number is not None:
                extras[str(key)] = number
    else:
        raw = result
    score = _as_number(raw)
    if score is None:
        return Outcome(False, 0.0, {}, f"returned {type(raw).__name__} {raw!r:.80}; return a float or a dict with "
                                       "a float 'score'")
    if not math.isfinite(score):
        return Outcome(False, 0.0, {}, f"returned a non-finite score {score}")
    return Outcome(True, score, extras, None)


def evaluate(fn: Callable, item: tuple) -> Outcome:
    """Score one `(data_source, solution_str, ground_truth, extra_info)`; never raises (except Ctrl-C)."""
    try:
        return normalise(fn(*item))
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # SystemExit from a user's function is a failed sample too
        return Outcome(False, 0.0, {}, f"{type(e).__name__}: {e}"[:500])


def worker_main(conn, parent_pid: int, fn: Callable) -> None:
    """Loop of a process-backend worker: receive `(task_id, item)`, send `(task_id, Outcome)`; None or EOF ends it.

    The worker leads its own process group so that killing a hung one also kills whatever it started (a sandbox,
    a compiler). It announces itself with ("ready", None) once the function is loaded, or ("load_error", msg).
    It ignores the job-wide signals (started with them blocked): the trainer stops it, with SIGKILL at the latest.
    A worker stuck inside a reward function never reads the pipe's EOF, so the kernel kills it with the parent.
    """
    enter_child(parent_pid, own_group=True)
    # The parent handles Ctrl-C and closes workers; a worker in its own group does not see the terminal's SIGINT.
    try:
        if hasattr(fn, "load"):  # a user's file is imported here, before the worker takes tasks
            fn.load()
    except BaseException as e:
        conn.send(("load_error", f"{type(e).__name__}: {e}"))
        return
    if "torch" in sys.modules:  # the function imported torch: one thread per worker, there are several workers
        sys.modules["torch"].set_num_threads(1)
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        task_id, item = msg
        conn.send((task_id, evaluate(fn, item)))
