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

from recipe_phases import time_variants  # tools/bench/, beside this file

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
    time_variants(RECIPE, RUNS, parser.parse_args().steps, 64, "reward", "judge")


if __name__ == "__main__":
    main()
