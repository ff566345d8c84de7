"""What a generative judge costs a step, next to rollout and training, on this CPU: recipes/cpu/tiny_judge_ppo.yaml
(64 samples a step, the built-in digit_max_judge) with the judge in the trainer's process, in a process of its own,
and in a process of its own under fully_async (one batch generated ahead, a sync every step, the policy's engine in
a process of its own). The judge scores in the trainer's `reward` phase on global rank 0.

Printed per run (medians over the steps after the first): the step, the rollout (sync: the step's generation;
fully_async: the time the trainer waited for it), the judging (`timing/reward_s`), the actor's update, and
samples/s. In fully_async the policy's engine generates the next batch while the trainer judges and updates.

    python tools/bench/bench_judge_step.py [--steps 8]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

from megappo.testing.recipes import run_recipe

RECIPE = "recipes/cpu/tiny_judge_ppo.yaml"
OWN = ("reward_model.judge.inference.hybrid_engine=false",)
ASYNC = ("async_training.mode=fully_async", "async_training.partial_rollout=true",
         "async_training.trigger_parameter_sync_step=1", "async_training.staleness_threshold=1",
         "async_training.require_batches=2", "actor_rollout_ref.hybrid_engine=false", "trainer.guard.enable=false")
RUNS = {"judge in the trainer, sync": (), "judge in its own process, sync": OWN,
        "judge in its own process, fully_async": (*OWN, *ASYNC)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-judge-step-") as tmp:
        task = None  # the policy and the judge are warm-started by the first run and copied into the others
        for label, extra in RUNS.items():
            out = Path(tmp) / label.replace(" ", "_").replace(",", "")
            if task is not None:
                shutil.copytree(task, out / "synthetic")
            rows = run_recipe(RECIPE, out, f"trainer.total_training_steps={args.steps}", "trainer.val_before_train=false",
                              "trainer.test_freq=-1", "trainer.save_freq=-1", *extra)
            task = task or out / "synthetic"
            steps = [r for r in rows if r["step"] > 1]
            med = {k: statistics.median(r.get(k, 0.0) for r in steps) for k in
                   ("timing/step_s", "timing/rollout_s", "timing/wait_for_rollout_s", "timing/reward_s",
                    "timing/update_actor_s")}
            rollout = med["timing/wait_for_rollout_s"] if "fully_async" in label else med["timing/rollout_s"]
            print(f"{label:40s} step {med['timing/step_s']:6.3f} s  rollout {rollout:6.3f} s  judge "
                  f"{med['timing/reward_s']:6.3f} s  update {med['timing/update_actor_s']:6.3f} s  "
                  f"{64 / med['timing/step_s']:6.1f} samples/s", flush=True)


if __name__ == "__main__":
    main()
