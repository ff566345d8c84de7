"""Where a run's numbers go: `<default_local_dir>/metrics.jsonl` (always), TensorBoard, the console.

Only global rank 0 writes. Every step is one JSON object with a `step` field in metrics.jsonl and one scalar per
key in TensorBoard's event files under `<default_local_dir>/tensorboard/`; the console shows a progress bar with
the step, reward and KL, and one line of the main metrics per step.

A step the KL guard rolls back is logged twice: its undone attempt, then its retry. metrics.jsonl keeps both rows
in the order they happened, the undone one marked `"guard/rolled_back": 1.0`, and `read_steps` reads one row per
step (the last logged). TensorBoard puts undone attempts in a run of their own, `tensorboard/rolled_back/`, so the
curves of `tensorboard/` hold one point per step.
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

ROLLED_BACK = "guard/rolled_back"  # the mark of a row whose step a rollback undid
CONSOLE_KEYS = ("reward/mean", "kl/mean", "actor/pg_loss", "critic/vf_loss", "response/length_mean",
                "timing/step_s")
# each feature's own numbers, after CONSOLE_KEYS on the steps that have them (only a run with the feature logs them):
# environments' and agent programs' reward, agent programs' calls and failures, failed episodes (dropped from the
# loss), on-policy distillation's divergence, the judge's unparsed verdicts and its rule score, R3's router agreement
FEATURE_KEYS = ("env/reward_mean", "agent/calls_per_episode", "agent/error_fraction", "episodes/failed_fraction",
                "distill/reverse_kl", "actor/distill_loss", "reward/judge_unparsed_fraction",
                "reward/rule_score_mean", "rollout/router_agreement")


def console_line(step: int, m: dict[str, float], hidden: tuple[str, ...] = ()) -> str:
    """A step's console line: CONSOLE_KEYS, then the FEATURE_KEYS the step has, then its validation rewards, each
    key=value (4 significant digits); `hidden` keys are left out (a feature that logs a key it does not mean, as the
    tool loop logs env/reward_mean 0)."""
    keys = [k for k in (*CONSOLE_KEYS, *FEATURE_KEYS) if k in m and k not in hidden]
    keys += [k for k in m if k.startswith("val/") and k.endswith("reward_mean")]
    return " ".join([f"step {step}:", *(f"{k}={m[k]:.4g}" for k in keys)])


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
                 resumed: bool = False, run_name: tuple[str, str] = ("megappo", "run"), hidden: tuple[str, ...] = ()):
        """A resumed run (`resumed`, from the checkpoint of `start_step`) keeps the rows up to that step and drops
        what the interrupted process logged after it, which this run logs again; a fresh run starts empty. So the
        files of a run that was killed and resumed hold what an uninterrupted run's hold. `hidden`: keys kept off
        the console line (`console_line`)."""
        self.enabled = enabled
        self.hidden = tuple(hidden)
        self.sinks = set(sinks)
        self.jsonl = None
        self.out_dir = out_dir
        self.tb = None
        self.tb_rolled_back = None  # opened at the first undone attempt (or on a resume, to purge the killed process's)
        self.tb_undone: Optional[tuple[int, dict]] = None  # the tripped attempt, until its rollback is done
        self.bar = None
        self.wandb = None  # a wandb run
        if not enabled:
            return
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "metrics.jsonl")
        _keep_rows(path, start_step if resumed else None)
        self.jsonl = open(path, "a", encoding="utf-8")
        if "tensorboard" in self.sinks:
            # purge_step: TensorBoard hides the earlier process's events from this step on
            self.tb_purge = start_step + 1 if resumed else 0
            self.tb = self._tb_writer("")
            if os.path.isdir(os.path.join(out_dir, "tensorboard", "rolled_back")):
                self.tb_rolled_back = self._tb_writer("rolled_back")
        if "wandb" in self.sinks:
            import wandb  # validated to be installed when asked for

            self.wandb = wandb.init(project=run_name[0], name=run_name[1], dir=out_dir, resume="allow")
        if "console" in self.sinks:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="megappo", unit="step", file=sys.stderr,
                            dynamic_ncols=True, disable=not sys.stderr.isatty())

    def log(self, step: int, metrics: dict[str, float], *, rolled_back: bool = False) -> None:
        """One step's row; `rolled_back`: an attempt the guard undoes (marked, and kept off the step's curves)."""
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in sorted({**metrics, **({ROLLED_BACK: 1.0} if rolled_back else {})}.items())}
        self.jsonl.write(json.dumps({"step": step, **{k: _json_number(v) for k, v in clean.items()}}) + "\n")
        self.jsonl.flush()
        if self.tb is not None and rolled_back:
            self.tb_undone = (step, clean)  # written by rolled_back_to, after the steps it undoes before this one
        elif self.tb is not None:
            self._tb_scalars(self.tb, step, clean)
        # wandb keeps the first value logged at a step: an undone attempt would hide its retry
        if self.wandb is not None and not rolled_back:
            self.wandb.log(clean, step=step)
        if "console" in self.sinks:
            self._console(step, clean)

    def rolled_back_to(self, step: int) -> None:
        """The run went back to the checkpoint of `step`: the rows logged for later steps are undone attempts too
        (a checkpoint older than the tripped step's predecessor undoes the good steps between), so they are marked
        in metrics.jsonl and moved to TensorBoard's rolled_back run."""
        if not self.enabled:
            return
        self.jsonl.close()
        path = os.path.join(self.out_dir, "metrics.jsonl")
        undone = _mark_rolled_back(path, after=step)
        self.jsonl = open(path, "a", encoding="utf-8")
        if self.tb is None:
            return
        if undone:
            _purge_tb(self.tb, step + 1)
        for row in undone:
            self._tb_scalars(self._rolled_back_tb(), row["step"],
                             {k: v for k, v in row.items() if k != "step" and v is not None})
        self._flush_tb_undone()

    def _flush_tb_undone(self) -> None:
        if self.tb_undone is not None:
            self._tb_scalars(self._rolled_back_tb(), *self.tb_undone)
            self.tb_undone = None

    def _tb_writer(self, sub: str):
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(os.path.join(self.out_dir, "tensorboard", sub), purge_step=self.tb_purge)

    def _rolled_back_tb(self):
        if self.tb_rolled_back is None:
            self.tb_rolled_back = self._tb_writer("rolled_back")
        return self.tb_rolled_back

    @staticmethod
    def _tb_scalars(writer, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            writer.add_scalar(k, v, step)
        writer.flush()

    def _console(self, step: int, m: dict[str, float]) -> None:
        if self.bar is not None and not self.bar.disable:
            self.bar.set_postfix({"reward": f"{m.get('reward/mean', math.nan):.3f}",
                                  "kl": f"{m.get('kl/mean', math.nan):.4f}"}, refresh=False)
            self.bar.update(step - self.bar.n)
        print(console_line(step, m, self.hidden), file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self._flush_tb_undone()  # a run the guard stopped: its last attempt was not rolled back
        for writer in (self.tb, self.tb_rolled_back):
            if writer is not None:
                writer.close()
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


def _mark_rolled_back(path: str, after: int) -> list[dict]:
    """Mark the unmarked rows of steps after `after` as undone (rewriting metrics.jsonl atomically); those rows."""
    rows = read_rows(os.path.dirname(path) or ".")
    undone = [r for r in rows if r["step"] > after and not r.get(ROLLED_BACK)]
    if undone:
        for r in undone:
            r[ROLLED_BACK] = 1.0
        write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))
    return undone


def _purge_tb(writer, step: int) -> None:
    """TensorBoard drops the events this writer logged from `step` on: the restart mark SummaryWriter(purge_step=)
    writes."""
    from tensorboard.compat.proto.event_pb2 import Event, SessionLog

    writer.file_writer.add_event(Event(step=step, session_log=SessionLog(status=SessionLog.START)))
    writer.flush()


def read_rows(out_dir: str) -> list[dict]:
    """Every row of `<out_dir>/metrics.jsonl` in the order logged, undone attempts included (a line cut short by a
    killed process is left out)."""
    rows = []
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return rows
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def one_per_step(rows: list[dict]) -> list[dict]:
    """The row that stands for each step, in step order: the last one logged, as a rolled-back attempt (or a step a
    rollback undid) is followed by its retry."""
    last: dict[int, dict] = {}
    for row in rows:
        last[row["step"]] = row
    return [last[s] for s in sorted(last)]


def read_steps(out_dir: str) -> list[dict]:
    """One row per step of `<out_dir>/metrics.jsonl` (validation before training is step 0): what the run's curves
    are made of."""
    return one_per_step(read_rows(out_dir))


def _json_number(v: float) -> Optional[float]:
    return v if math.isfinite(v) else None  # JSON has no NaN/inf: null, which readers treat as missing
