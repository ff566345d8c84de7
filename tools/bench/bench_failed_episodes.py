"""What failed episodes teach: recipes/cpu/tiny_openai_agent_ppo.yaml over several seeds, with and without an agent
that raises after its first call in a share of its episodes (megappo/testing/flaky_agent.py), under each
`rollout.agent.on_failure`.

Each run is `python -m megappo.cli train --config recipes/cpu/tiny_openai_agent_ppo.yaml ...` in a fresh folder
(the guess_number task's warm start is made once and copied), validation off. Printed per condition: the rise in
reward (`megappo.testing.recipes.learned`: the mean reward/mean of the last five steps minus the first five's;
with drop reward/mean is the reward of the episodes trained on, with zero_reward and keep that of all),
its mean and standard deviation over the seeds, the mean early KL (kl/mean of steps 2-4) and seconds per step.

    python tools/bench/bench_failed_episodes.py --seeds 0 2 3 --fail 0.2 --steps 40

One run is ~2 minutes on 2 cores; the default, 3 conditions x 3 seeds, is ~20 minutes.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECIPE = "recipes/cpu/tiny_openai_agent_ppo.yaml"
def run(work: Path, task: Path, name: str, share: float, seed: int, steps: int, *overrides: str) -> list[dict]:
    out = work / name
    shutil.copytree(task, out / "synthetic")
    (out / "agents.yaml").write_text("- name: guess_number\n  agent: megappo.testing.flaky_agent:play\n"
                                     f"  kwargs: {{share: {share}}}\n  deadline_s: 120\n")
    cmd = [sys.executable, "-m", "megappo.cli", "train", "--config", RECIPE, f"trainer.default_local_dir={out}",
           f"actor_rollout_ref.rollout.agent.agent_loop_config_path={out / 'agents.yaml'}", "trainer.test_freq=-1",
           "trainer.val_before_train=false", f"trainer.total_training_steps={steps}", f"data.seed={seed}",
           *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, text=True)
    from megappo.trainer.metrics import one_per_step, read_steps

    return [r for r in one_per_step(read_steps(str(out))) if r["step"] > 0]


def summary(rows: list[dict]) -> dict[str, float]:
    from megappo.testing.recipes import learned

    early = [r.get("kl/mean", 0.0) for r in rows[1:4]]
    return {"rise": learned(rows), "early_kl": sum(early) / max(len(early), 1),
            "step_s": sum(r["timing/step_s"] for r in rows) / len(rows),
            "failed": sum(r.get("episodes/failed_fraction", 0.0) for r in rows) / len(rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 2, 3])
    ap.add_argument("--fail", type=float, default=0.2, help="share of episodes whose agent raises")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--conditions", nargs="+", default=["clean", "drop", "zero_reward"])
    args = ap.parse_args()
    from megappo.config import load_config
    from megappo.tasks import prepare_task

    work = Path(tempfile.mkdtemp(prefix="bench_failed_"))
    try:
        syn = load_config(RECIPE).data.synthetic
        task = work / "task"
        prepare_task(syn.name, str(task / syn.name), num_train_prompts=syn.num_train_prompts,
                     num_val_prompts=syn.num_val_prompts, warm_start_steps=syn.warm_start_steps, seed=syn.seed)
        for cond in args.conditions:
            share = 0.0 if cond == "clean" else args.fail
            policy = "drop" if cond == "clean" else cond
            got = [summary(run(work, task, f"{cond}_{seed}", share, seed, args.steps,
                               f"actor_rollout_ref.rollout.agent.on_failure={policy}")) for seed in args.seeds]
            rises = [g["rise"] for g in got]
            print(json.dumps({"condition": cond, "fail": share, "seeds": args.seeds,
                              "rise": [round(x, 3) for x in rises], "rise_mean": round(statistics.mean(rises), 3),
                              "rise_sd": round(statistics.stdev(rises), 3) if len(rises) > 1 else None,
                              "early_kl": round(statistics.mean(g["early_kl"] for g in got), 3),
                              "step_s": round(statistics.mean(g["step_s"] for g in got), 2),
                              "failed": round(statistics.mean(g["failed"] for g in got), 3)}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
