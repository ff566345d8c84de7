"""Golden metrics: every CPU recipe's `metrics.jsonl`, recorded once and repeated bit for bit after any change
that is meant to move no number (a reorganisation of the code).

A golden file (`tests/golden/<name>.jsonl`) is one header line (the run: recipe, overrides, ranks; the CPU and
torch that recorded it) and then the run's rows as logged, rolled-back attempts included, without the keys that
describe the machine rather than the run (`timing/`, `perf/`).

Float results depend on the CPU's instruction set (vector widths change summation order), so every run is made
under `GOLDEN_ENV`: ATen's scalar kernels, MKL's conditional-numerical-reproducibility path that every x86 CPU
takes the same way, one thread. Under it two CPUs of different vector widths should give the same bits; where a
comparison still differs on another CPU than the recording one, `compare` says so rather than calling it a bug.

`python tools/golden.py record|compare [NAME ...]` is the command line (`tools/golden.py --help`).
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional

from megappo.testing.recipes import REPO, run_recipe
from megappo.trainer.metrics import read_rows

GOLDEN_DIR = REPO / "tests" / "golden"
MACHINE_KEYS = ("timing/", "perf/")
MACHINE_SUFFIXES = ("latency_s",)  # wall-clock measures logged beside a capability's own metrics (tool/latency_s)
# what depends on how fast the machine is: generation batches already finished when the trainer asks
MACHINE_NAMES = ("async/queue_size",)
# What the wall clock decides in an asynchronous run: a weight sync that lands while a generation is still running
# aborts it (partial rollouts continue its samples under the new weights), or a batch that waited too long is dropped.
# On a busy machine that happens at other steps than in the recorded run, and every later number follows; a
# comparison whose first difference is one of these is the schedule's timing, not the code's.
SCHEDULE_KEYS = ("async/partial_fraction", "async/dropped_stale", "async/staleness_mean", "async/staleness_max")
GOLDEN_ENV = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "1",
              "MKL_NUM_THREADS": "1"}


@dataclass(frozen=True)
class GoldenRun:
    """One recorded run: a recipe as a user launches it, with `overrides`, on `nproc` ranks."""

    recipe: str
    overrides: tuple[str, ...] = ()
    nproc: int = 1
    server: Optional[str] = None  # the engine ("sglang", "vllm") whose own environment's python the run needs
    timeout: float = 1200
    # keys left out of this run's golden: an agent program's calls share engine batches as they arrive, and the
    # engine's log-probs of the same tokens round differently in other batches (a few 1e-7), so what compares them
    # with the trainer's moves; every sampled token, reward and loss is still compared
    loose: tuple[str, ...] = ()


AGENT_PROGRAM_RECIPES = ("tiny_openai_agent_ppo", "tiny_openai_tool_agent_ppo")
ARRIVAL_BATCHED = ("rollout/logprob_diff", "rollout_corr/")


def _cpu_recipes() -> dict[str, GoldenRun]:
    runs = {}
    for path in sorted((REPO / "recipes" / "cpu").glob("*.yaml")):
        nproc = 4 if path.stem == "tiny_ppo_tp2pp2" else 1  # the recipe's TP2 x PP2
        loose = ARRIVAL_BATCHED if path.stem in AGENT_PROGRAM_RECIPES else ()
        runs[path.stem] = GoldenRun(f"recipes/cpu/{path.name}", nproc=nproc, loose=loose)
    return runs


# Every CPU recipe at its full length, and the main job with a real SGLang or vLLM server as its rollout (short: the
# CPU server's start-up dominates). Greedy: SGLang honours the samples' seeds only with deterministic inference, which
# its CPU attention backend (torch_native) refuses, so sampled tokens would not repeat; vLLM batches concurrent
# requests as they arrive, which moves a sampled token where float noise decides a draw. vLLM's run trains
# digit_max on heads of 32 dimensions (its CPU attention has no kernel for 16).
RUNS: dict[str, GoldenRun] = {
    **_cpu_recipes(),
    "tiny_ppo_sglang": GoldenRun("recipes/cpu/tiny_ppo.yaml", (
        "actor_rollout_ref.rollout.name=sglang",
        "actor_rollout_ref.rollout.do_sample=false",
        "trainer.total_training_steps=3", "trainer.test_freq=-1",
        "trainer.save_freq=-1", "trainer.val_before_train=false"), server="sglang"),
    "tiny_ppo_vllm": GoldenRun("recipes/cpu/tiny_ppo.yaml", (
        "actor_rollout_ref.rollout.name=vllm", "data.synthetic.name=digit_max_h32",
        "actor_rollout_ref.rollout.do_sample=false",
        "trainer.total_training_steps=3", "trainer.test_freq=-1",
        "trainer.save_freq=-1", "trainer.val_before_train=false"), server="vllm"),
}


def cpu_signature() -> str:
    """The CPU model and its vector extensions, and torch's version: what float summation order depends on."""
    import torch

    flags, model = "", platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    flags = " ".join(sorted(x for x in line.split(":", 1)[1].split() if x.startswith(("avx", "fma"))))
                    break
    except OSError:
        pass
    return f"{model} | {flags} | torch {torch.__version__}"


def strip_machine_keys(rows: list[dict], loose: tuple[str, ...] = ()) -> list[dict]:
    """The rows without what the machine decides (and a run's `GoldenRun.loose` keys)."""
    return [{k: v for k, v in row.items() if not k.startswith(MACHINE_KEYS + loose)
             and not k.endswith(MACHINE_SUFFIXES) and k not in MACHINE_NAMES}
            for row in rows]


def run(name: str, out: Path, server_pythons: Optional[Mapping[str, str]] = None) -> list[dict]:
    """Train golden run `name` into `out` under `GOLDEN_ENV`; its rows (machine keys left out). server_pythons: each
    engine's environment's python (the runs whose rollout is a server of that engine need it)."""
    spec = RUNS[name]
    overrides = list(spec.overrides)
    if spec.server:
        python = (server_pythons or {}).get(spec.server)
        if not python:
            raise ValueError(f"{name} needs a {spec.server} environment: pass its python (--{spec.server}-python)")
        overrides.append(f"actor_rollout_ref.rollout.server_python={python}")
    run_recipe(spec.recipe, out, *overrides, nproc=spec.nproc, timeout=spec.timeout, env=GOLDEN_ENV)
    return strip_machine_keys(read_rows(str(out)), spec.loose)


def path_of(name: str) -> Path:
    return GOLDEN_DIR / f"{name}.jsonl"


def write(name: str, rows: list[dict], directory: Path = GOLDEN_DIR) -> Path:
    spec = RUNS[name]
    header = {"golden": name, **asdict(spec), "cpu": cpu_signature(), "env": GOLDEN_ENV}
    path = directory / f"{name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(x, sort_keys=True) + "\n" for x in [header, *rows]))
    os.replace(tmp, path)
    return path


def read(name: str, directory: Path = GOLDEN_DIR) -> tuple[dict, list[dict]]:
    """The golden file's header and rows."""
    path = directory / f"{name}.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"no golden for {name!r} at {path}: record it with `python tools/golden.py record "
                                f"{name}`")
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return lines[0], lines[1:]


def differences(got: list[dict], want: list[dict], limit: int = 10, new_keys: bool = True) -> list[str]:
    """What differs between two runs' rows, key by key and bit for bit (floats compared as the JSON numbers they
    were logged as), at most `limit` lines; [] when they are the same. new_keys=False: keys the golden lacks are
    not differences (a run that logs a new metric and moves no old one)."""
    out = []
    if len(got) != len(want):
        out.append(f"{len(got)} rows, the golden has {len(want)} (steps {[r.get('step') for r in got]} vs "
                   f"{[r.get('step') for r in want]})")
    for i, (g, w) in enumerate(zip(got, want)):
        where = f"row {i} (step {w.get('step')})"
        gone, new = sorted(set(w) - set(g)), sorted(set(g) - set(w))
        if gone:
            out.append(f"{where}: missing {gone}")
        if new and new_keys:
            out.append(f"{where}: new keys {new}")
        for key in sorted(set(g) & set(w)):
            if g[key] != w[key] or type(g[key]) is not type(w[key]):
                out.append(f"{where}: {key} = {g[key]!r}, golden {w[key]!r}")
        if len(out) >= limit:
            return out[:limit] + ["..."]
    return out


@dataclass
class Outcome:
    name: str
    differences: list[str] = field(default_factory=list)
    error: str = ""
    other_cpu: str = ""  # the recording CPU, where it is not this one
    schedule: str = ""  # the first difference is the asynchronous schedule's timing (`SCHEDULE_KEYS`)

    @property
    def ok(self) -> bool:
        return (not self.differences or bool(self.schedule)) and not self.error


def record_one(name: str, server_pythons: Optional[Mapping[str, str]] = None,
               directory: Path = GOLDEN_DIR) -> Outcome:
    with tempfile.TemporaryDirectory(prefix=f"golden-{name}-") as tmp:
        try:
            rows = run(name, Path(tmp) / name, server_pythons)
        except Exception as e:  # a failed run (its AssertionError holds the output) is the message
            return Outcome(name, error=str(e)[-3000:])
        write(name, rows, directory)
    return Outcome(name)


def compare_one(name: str, server_pythons: Optional[Mapping[str, str]] = None, directory: Path = GOLDEN_DIR,
                keep: Optional[Path] = None) -> Outcome:
    """Run `name` again and compare its rows with its golden. `keep`: leave the run's directory there."""
    header, want = read(name, directory)
    tmp = Path(tempfile.mkdtemp(prefix=f"golden-{name}-"))
    try:
        got = run(name, tmp / name, server_pythons)
    except Exception as e:
        return Outcome(name, error=str(e)[-3000:])
    finally:
        if keep is not None:
            shutil.copytree(tmp, keep / name, dirs_exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    other = header["cpu"] if header["cpu"] != cpu_signature() else ""
    return Outcome(name, differences(got, want), other_cpu=other, schedule=schedule_timing(got, want))


def extend_one(name: str, server_pythons: Optional[Mapping[str, str]] = None,
               directory: Path = GOLDEN_DIR) -> Outcome:
    """Record `name` again only if every number its golden holds comes out the same (new keys allowed): the way
    to add a metric without re-deciding the old ones."""
    header, want = read(name, directory)
    with tempfile.TemporaryDirectory(prefix=f"golden-{name}-") as tmp:
        try:
            got = run(name, Path(tmp) / name, server_pythons)
        except Exception as e:
            return Outcome(name, error=str(e)[-3000:])
    moved = differences(got, want, new_keys=False)
    if not moved:
        write(name, got, directory)
    other = header["cpu"] if header["cpu"] != cpu_signature() else ""
    return Outcome(name, moved, other_cpu=other)


def schedule_timing(got: list[dict], want: list[dict]) -> str:
    """Where the first row that differs differs in what the asynchronous schedule's timing decides (`SCHEDULE_KEYS`),
    which step and key; "" otherwise."""
    for g, w in zip(got, want):
        if g != w:
            moved = [k for k in SCHEDULE_KEYS if k in g and k in w and g[k] != w[k]]
            return f"step {w.get('step')}: {moved[0]} = {g[moved[0]]!r}, golden {w[moved[0]]!r}" if moved else ""
    return ""


def run_all(names: list[str], one: Callable[[str], Outcome], jobs: int) -> list[Outcome]:
    """`one` for each name, `jobs` at a time (multi-rank runs alone: they take the machine's cores)."""
    single = [n for n in names if RUNS[n].nproc == 1]
    multi = [n for n in names if RUNS[n].nproc > 1]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        outcomes = list(pool.map(one, single))
    return outcomes + [one(n) for n in multi]
