"""Where a run's numbers go: `<default_local_dir>/metrics.jsonl` (always), TensorBoard, the console.

Only global rank 0 writes. Every step is one JSON object with a `step` field in metrics.jsonl and one scalar per
key in TensorBoard's event files under `<default_local_dir>/tensorboard/`; the console shows a progress bar with
the step, reward and KL, and one line of the main metrics per step.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from typing import Iterator, Optional

from megappo.trainer.files import write_atomic

CONSOLE_KEYS = ("reward/mean", "kl/mean", "actor/pg_loss", "critic/vf_loss", "response/length_mean",
                "timing/step_s")


class Timer:
    """Wall-clock seconds per named phase of one step: `with timer("rollout"): ...` -> timing/rollout_s."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        return {f"timing/{k}_s": v for k, v in self.seconds.items()}


class MetricsLogger:
    def __init__(self, out_dir: str, sinks: list[str], total_steps: int, *, enabled: bool, start_step: int = 0,
                 resumed: bool = False, run_name: tuple[str, str] = ("megappo", "run")):
        """A resumed run (`resumed`, from the checkpoint of `start_step`) keeps the rows up to that step and drops
        what the interrupted process logged after it, which this run logs again; a fresh run starts empty. So the
        files of a run that was killed and resumed hold what an uninterrupted run's hold."""
        self.enabled = enabled
        self.sinks = set(sinks)
        self.jsonl = None
        self.tb = None
        self.bar = None
        self.wandb = None  # a wandb run
        if not enabled:
            return
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "metrics.jsonl")
        _keep_rows(path, start_step if resumed else None)
        self.jsonl = open(path, "a", encoding="utf-8")
        if "tensorboard" in self.sinks:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard hides the earlier process's events from this step on
            self.tb = SummaryWriter(os.path.join(out_dir, "tensorboard"),
                                    purge_step=start_step + 1 if resumed else 0)
        if "wandb" in self.sinks:
            import wandb  # validated to be installed when asked for

            self.wandb = wandb.init(project=run_name[0], name=run_name[1], dir=out_dir, resume="allow")
        if "console" in self.sinks:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="megappo", unit="step", file=sys.stderr,
                            dynamic_ncols=True, disable=not sys.stderr.isatty())

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in sorted(metrics.items())}
        self.jsonl.write(json.dumps({"step": step, **{k: _json_number(v) for k, v in clean.items()}}) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for k, v in clean.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(clean, step=step)
        if "console" in self.sinks:
            self._console(step, clean)

    def _console(self, step: int, m: dict[str, float]) -> None:
        shown = {k: m[k] for k in CONSOLE_KEYS if k in m}
        if self.bar is not None and not self.bar.disable:
            self.bar.set_postfix({"reward": f"{m.get('reward/mean', math.nan):.3f}",
                                  "kl": f"{m.get('kl/mean', math.nan):.4f}"}, refresh=False)
            self.bar.update(step - self.bar.n)
        line = " ".join(f"{k}={v:.4g}" for k, v in shown.items())
        val = " ".join(f"{k}={v:.4g}" for k, v in m.items() if k.startswith("val/") and k.endswith("reward_mean"))
        print(f"step {step}: {line}{' ' + val if val else ''}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.jsonl is not None:
            self.jsonl.close()


def _keep_rows(path: str, last_step: Optional[int]) -> None:
    """Rewrite metrics.jsonl (atomically) with only its rows up to `last_step` (None: none)."""
    if not os.path.exists(path):
        return
    kept = []
    if last_step is not None:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # the last line of a process killed while writing it
                    continue
                if row.get("step", 0) <= last_step:
                    kept.append(line if line.endswith("\n") else line + "\n")
    write_atomic(path, "".join(kept))


def _json_number(v: float) -> Optional[float]:
    return v if math.isfinite(v) else None  # JSON has no NaN/inf: null, which readers treat as missing
