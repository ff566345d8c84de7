"""What a built-in task's build says on the console while it runs: its supervised warm start takes seconds to
minutes before a run's first step (tiny_env_ppo's about a minute), which would otherwise look like a hung trainer.

Rank 0 says it (the trainer builds a task on rank 0 while the others wait; a process outside torch.distributed is
rank 0). Nothing is said when the task's files are reused."""
from __future__ import annotations

import sys
import time
from typing import Callable, Optional


def _rank0() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _say(text: str) -> None:
    print(f"megappo: {text}", file=sys.stderr, flush=True)


def announced(what: str, steps: Optional[int], out_dir: str, build: Callable[[], dict]) -> dict:
    """`build()`'s manifest, with a line before it (the built-in `what`, its warm start's `steps`, where) and one
    after (how long it took and what the warm start reached on held-out prompts: the manifest's `warm_start`)."""
    rank0 = _rank0()
    if rank0:
        _say(f"building the built-in {what} in {out_dir}: a tiny model and its supervised warm start of {steps} "
             "steps, before the first RL step (once: a run with the same settings reuses it)")
    t0 = time.perf_counter()
    manifest = build()
    if rank0:
        reached = {k: v for k, v in (manifest.get("warm_start") or {}).items() if k not in ("steps", "seconds")}
        _say(f"the built-in {what} built in {time.perf_counter() - t0:.1f} s (warm start: "
             f"{', '.join(f'{k}={v}' for k, v in reached.items()) or 'no metrics'})")
    return manifest
