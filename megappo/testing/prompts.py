"""Small Parquet prompt sets in verl's schema for tests and benchmarks (no download, deterministic)."""
from __future__ import annotations

import os
import random


def write_prompt_parquet(path: str, n: int, *, seed: int = 0, data_source: str = "openai/gsm8k") -> str:
    """`n` short arithmetic prompts with GSM8K-style numeric ground truths, written as one Parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        rows.append({
            "data_source": data_source,
            "prompt": [{"role": "user", "content": f"how many apples is {a} and {b} apples?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": "train", "index": i},
        })
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def tiny_run_overrides(out_dir: str, model_dir: str, train_file: str, *, val_file: str | None = None,
                       steps: int = 1, extra: tuple[str, ...] | list[str] = ()) -> list[str]:
    """Overrides of recipes/gsm8k/tiny_cpu.yaml for a fast trainer run on a tiny model (tests, benchmarks). No
    checkpoints unless `extra` sets trainer.save_freq: a few steps at the recipe's lr 1e-5 do not spike, and a
    test that trips the KL guard without one fails loudly (RunStopped)."""
    return [
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={train_file}",
        f"data.val_files={val_file or 'null'}", f"trainer.default_local_dir={out_dir}",
        "data.max_prompt_length=64", "data.max_response_length=8", f"trainer.total_training_steps={steps}",
        "trainer.logger=[]", "reward_model.backend=serial", "trainer.save_freq=-1", *extra,
    ]


def read_metrics(out_dir: str) -> list[dict]:
    """Every row of `<out_dir>/metrics.jsonl` in the order logged (validation before training is step 0): a step the
    KL guard rolled back has two, its undone attempt (`guard/rolled_back`) and its retry. One row per step, what a
    curve is made of: `megappo.trainer.metrics.read_steps`."""
    import json

    with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def metrics_so_far(out_dir) -> list[dict]:
    """The rows of `<out_dir>/metrics.jsonl` of a run that may still be writing it: none before the file exists, and
    a line being written is left out."""
    from megappo.trainer.metrics import read_rows

    return read_rows(str(out_dir))


UNTIMED = ("timing/", "perf/")
# what a skipped sync (a run that stops after this step: RolloutWorker.skip_sync) does not measure
SYNC_COUNTS = ("rollout/weight_sync_bytes", "rollout/weight_sync_skipped", "rollout/verify_sync_max_diff")


def comparable(want: dict, have: dict) -> tuple[dict, dict]:
    """Two metrics rows of the same step without what may differ between an uninterrupted run and an interrupted
    one of the same config: timings and speeds, and the weight sync's byte count and check where a stopping run
    skipped it."""
    drop = SYNC_COUNTS if want.get("rollout/weight_sync_skipped") or have.get("rollout/weight_sync_skipped") else ()

    def keep(row: dict) -> dict:
        return {k: v for k, v in row.items() if not k.startswith(UNTIMED) and k not in drop}
    return keep(want), keep(have)


def assert_same_rows(expected: list[dict], got: list[dict], ignore: tuple[str, ...] = ()) -> None:
    """`got` logged `expected`'s steps with the same numbers (`comparable`; keys starting with `ignore` aside), and
    names every key of the first step that differs."""
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    for want, have in zip(expected, got):
        want, have = comparable(want, have)
        want = {k: v for k, v in want.items() if not k.startswith(ignore)}
        have = {k: v for k, v in have.items() if not k.startswith(ignore)}
        assert have == want, f"step {want['step']} differs: " + str(
            {k: (want.get(k), have.get(k)) for k in set(want) | set(have) if want.get(k) != have.get(k)})
