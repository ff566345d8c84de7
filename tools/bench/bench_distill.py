"""What a distillation teacher costs a step, next to rollout and training, on this CPU: recipes/cpu/tiny_distill.yaml
(its built-in student and teacher) with 32 prompts x 4 samples a step, the teacher in megatron beside the student,
on the in-process engine, and on the engine in a process of its own; each synchronous and fully asynchronous (one
batch generated ahead, a sync every step, the policy's engine in a process of its own).

Printed per run (medians over the steps after the first): the step, the rollout (sync: the step's generation;
fully_async: the time the trainer waited for it), the teacher's scoring, the actor's update, and samples/s. In
fully_async the policy's engine generates the next batch while the trainer scores with the teacher and updates:
where "rollout" falls below the sync run's, generation overlapped the teacher and the update.

    python tools/bench/bench_distill.py [--steps 8]
"""
from __future__ import annotations

import argparse

from recipe_phases import time_variants  # tools/bench/, beside this file

RECIPE = "recipes/cpu/tiny_distill.yaml"
BIG = ("data.train_batch_size=32", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
       "trainer.guard.enable=false")  # a batch generated ahead moves ppo_kl past the guard in the first steps
ASYNC = ("async_training.mode=fully_async", "async_training.partial_rollout=true",
         "async_training.trigger_parameter_sync_step=1", "async_training.staleness_threshold=1",
         "async_training.require_batches=2", "actor_rollout_ref.hybrid_engine=false")
ENGINE = ("distillation.teacher_model.backend=engine",)
OWN_PROCESS = (*ENGINE, "distillation.teacher_model.inference.hybrid_engine=false")
RUNS = {"megatron teacher, sync": (), "engine teacher, sync": ENGINE, "engine teacher (own process), sync": OWN_PROCESS,
        "megatron teacher, fully_async": ASYNC, "engine teacher (own process), fully_async": (*OWN_PROCESS, *ASYNC)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    time_variants(RECIPE, RUNS, parser.parse_args().steps, 128, "teacher", "teacher", BIG)


if __name__ == "__main__":
    main()
