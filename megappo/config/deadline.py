"""`trainer.save_before_deadline`: the wall-clock time a run must have saved and stopped by."""
from __future__ import annotations

import datetime as _dt
import os
from typing import Mapping, Optional


def parse_deadline(value: str, environ: Optional[Mapping[str, str]] = None) -> float:
    """Seconds since the epoch for an ISO 8601 time (local time unless it has an offset), a number of seconds since
    the epoch, or "slurm" (the job's end time, SLURM_JOB_END_TIME, which Slurm sets in a job's environment)."""
    env = os.environ if environ is None else environ
    text = str(value).strip()
    if text.lower() == "slurm":
        end = env.get("SLURM_JOB_END_TIME", "")
        if not end.strip().isdigit():
            raise ValueError("is 'slurm' but SLURM_JOB_END_TIME is not set (Slurm sets it inside a job since "
                             "23.02); give the time instead, e.g. 2026-12-04T06:00")
        return float(end)
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = _dt.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a time: use ISO 8601 (2026-12-04T06:00, 2026-12-04T06:00+01:00), "
                         "seconds since the epoch, or 'slurm'") from None
    return when.timestamp()  # a naive time is local time


def deadline_refusal(value: str, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The message refusing `value` as trainer.save_before_deadline, naming the fix (None: it parses); the config's
    rule and the run's start both ask it."""
    try:
        parse_deadline(value, environ)
    except ValueError as e:
        return f"trainer.save_before_deadline: {e}"
    return None
