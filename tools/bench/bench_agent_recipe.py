"""What the agent endpoint costs a run, in samples/s: the guess_number game as an environment
(recipes/cpu/tiny_env_ppo.yaml: the episode loop calls the engine itself) against the same game as an agent program
on the `openai` client (recipes/cpu/tiny_openai_agent_ppo.yaml: every turn an HTTP call to megappo's endpoint),
each synchronous and fully asynchronous (one batch generated ahead, a sync every step, partial rollouts).

Each run trains --steps steps of 64 episodes; printed per run: the median step time, the median rollout time of a
step (sync: the step's generation; fully_async: the time the trainer waited for it), and samples/s (64 / step time).

    python tools/bench/bench_agent_recipe.py [--steps 12]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from megappo.testing.recipes import run_recipe

ASYNC = ("async_training.mode=fully_async", "async_training.partial_rollout=true",
         "async_training.trigger_parameter_sync_step=1", "async_training.staleness_threshold=1",
         "async_training.require_batches=2", "actor_rollout_ref.hybrid_engine=false")
RUNS = {"environment, sync": ("tiny_env_ppo", ()), "environment, fully_async": ("tiny_env_ppo", ASYNC),
        "agent program, sync": ("tiny_openai_agent_ppo", ()),
        "agent program, fully_async": ("tiny_openai_agent_ppo", ASYNC)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-agent-recipe-") as tmp:
        for label, (recipe, extra) in RUNS.items():
            rows = run_recipe(f"recipes/cpu/{recipe}.yaml", Path(tmp) / label.replace(" ", "_").replace(",", ""),
                              f"trainer.total_training_steps={args.steps}", "trainer.val_before_train=false",
                              "trainer.test_freq=-1", "trainer.save_freq=-1", *extra)
            steps = [r for r in rows if r["step"] > 1]  # the first step pays the engine's and the endpoint's start
            step_s = statistics.median(r["timing/step_s"] for r in steps)
            key = "timing/wait_for_rollout_s" if extra else "timing/rollout_s"
            rollout_s = statistics.median(r[key] for r in steps)
            print(f"{label:28s} step {step_s:6.3f} s   rollout {rollout_s:6.3f} s   {64 / step_s:6.1f} samples/s")


if __name__ == "__main__":
    main()
