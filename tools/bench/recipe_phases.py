"""Shared by the benchmarks that time one phase of a CPU recipe's step beside rollout and update
(`bench_distill.py`, `bench_judge_step.py`): runs the recipe once per variant and prints each run's medians."""
from __future__ import annotations

import shutil
import statistics
import tempfile
from pathlib import Path

from megappo.testing.recipes import run_recipe


def time_variants(recipe: str, variants: dict[str, tuple[str, ...]], steps: int, samples: int, phase: str,
                  name: str, common: tuple[str, ...] = ()) -> None:
    """Train `recipe` for `steps` steps per variant (label -> overrides; the first run's warm-started models are
    copied into the others) and print the medians over steps 2.. of the step, the rollout (fully_async: the wait
    for it), `timing/<phase>_s` as `name`, the actor's update, and `samples` / step time."""
    with tempfile.TemporaryDirectory(prefix="bench-phases-") as tmp:
        task = None
        for label, extra in variants.items():
            out = Path(tmp) / "".join(c if c.isalnum() else "_" for c in label)
            if task is not None:
                shutil.copytree(task, out / "synthetic")
            rows = run_recipe(recipe, out, f"trainer.total_training_steps={steps}", "trainer.val_before_train=false",
                              "trainer.test_freq=-1", "trainer.save_freq=-1", *common, *extra)
            task = task or out / "synthetic"
            later = [r for r in rows if r["step"] > 1]  # the first step pays the engines' start
            med = {k: statistics.median(r.get(f"timing/{k}_s", 0.0) for r in later)
                   for k in ("step", "rollout", "wait_for_rollout", phase, "update_actor")}
            rollout = med["wait_for_rollout"] if "fully_async" in label else med["rollout"]
            print(f"{label:42s} step {med['step']:6.3f} s  rollout {rollout:6.3f} s  {name} {med[phase]:6.3f} s  "
                  f"update {med['update_actor']:6.3f} s  {samples / med['step']:6.1f} samples/s", flush=True)
