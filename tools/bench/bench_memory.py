"""Peak host memory of a full-parameter PPO run, by phase and by role: where the bytes per parameter go.

One `megappo.trainer.fit` in this process (world size 1, CPU, fp32, the in-process rollout engine) on a Qwen2 of
--hidden/--layers (default 102.3M parameters: hidden 768, 12 layers, intermediate 3072, the test tokenizer's
512-token vocabulary) with actor, critic and reference, GAE, the KL penalty in the reward, and the prompts, reward
and batch of tools/bench/bench_ppo_iteration.py. It reports:

- the peak resident set (VmHWM, reset at every phase through /proc/self/clear_refs) of setup and of each of the
  trainer's phases (`megappo.trainer.metrics.Timer`), in GB and in bytes per actor parameter;
- what lives after the first step, by role: parameters, gradient buffers and optimizer states of actor and critic,
  the reference's parameters, the engine's copy: tensors found through the models and optimizers, each storage
  counted once; the resident set before setup (Python, torch, megatron); and the rest, which nothing above holds
  (transient buffers the allocator kept, activations of a phase).

    python tools/bench/bench_memory.py [--hidden 768] [--layers 12] [--steps 2] [--micro 4]
        [--trace MODULE:QUALNAME] [--json out.json]

Measured on the 2-core CPU machine (102.3M parameters, batch 16 x 64 tokens, 2 steps; bytes per parameter; CPU:
user + system seconds of the run; the machine was shared, load average 15-50, so wall times mean little):

    configuration                                          peak   resident after a step   the rest   CPU s
    main: glibc's dynamic mmap threshold                   67.8   56.2                    11.6
    + threshold fixed at 64 KiB                            62.4   45.6                     1.0
    + gradients only in updates, engine freed (4 MiB)      54.5   37.8                     1.3
    + --micro 4 (the default 4 MiB threshold)              44.6   38.1                     1.5       104.5
      the same with glibc's dynamic threshold              45.3   38.2                     1.4        98.0
      the same with a 64 KiB threshold                     41.8   37.6                     1.0       124.8

glibc's mmap threshold rises with every large free (up to 32 MB), after which the trainer's transient buffers come
from the heap and stay resident when freed: the rest. `cpu_compat` fixes it at 4 MiB (MEGAPPO_MALLOC_MMAP_THRESHOLD
sets another, 0 leaves glibc's; a lower one holds less and costs page faults). The gradient buffers exist only
inside each role's update (the other role's 4 B are free during it) and the in-process engine's copy (4 B) is freed
from the rollout to the weight sync, so after a step: Python/torch/megatron 4.4, actor and critic parameters and
Adam states 12 each, the reference 4, the engine 4 (refilled by the sync). The updates add their role's gradients
(4) and the activations of a micro-batch: 16.8 B/param for the whole 16-sequence mini-batch, 4-7 with --micro 4
(ppo_micro_batch_size_per_gpu of actor and critic). For a 0.5B model the fixed 0.45 GB is under 1 B/param, so the
run holds about 37 B/param (18.5 GB) plus its role's gradients (2 GB) and a micro-batch's activations during an
update, which the micro-batch size bounds (with a 152K-token vocabulary the logits alone are 0.6 MB per token in
fp32; not measured at 0.5B here).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": "127.0.0.1"}.items():
    os.environ.setdefault(key, value)

GB = 1e9


def _status(field: str) -> int:
    """A /proc/self/status value in bytes (VmRSS: now, VmHWM: the peak since the last reset)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current VmRSS (Linux >= 4.0)


class PhasePeaks:
    """Peak and end resident set of each named phase, over every step (the max)."""

    def __init__(self) -> None:
        self.peak: dict[str, int] = {}
        self.after: dict[str, int] = {}

    def measure(self, name: str, fn, *args, **kwargs):
        _reset_peak()
        try:
            return fn(*args, **kwargs)
        finally:
            self.peak[name] = max(self.peak.get(name, 0), _status("VmHWM"))
            self.after[name] = max(self.after.get(name, 0), _status("VmRSS"))


def _storages(tensors) -> dict[int, int]:
    """Bytes of each distinct storage behind `tensors` (views of one buffer count once)."""
    out: dict[int, int] = {}
    for t in tensors:
        if t is None or not hasattr(t, "untyped_storage"):
            continue
        s = t.untyped_storage()
        out[s.data_ptr()] = s.nbytes()
    return out


def _role_tensors(role) -> dict[str, list]:
    """A role's parameters, its DDP gradient buffers and its optimizer's state tensors."""
    import torch

    params, grads, states = [], [], []
    for chunk in role.chunks:
        params += list(chunk.parameters())
        grads += [getattr(p, "main_grad", None) for p in chunk.parameters()]
        grads += [p.grad for p in chunk.parameters()]
        ddp_buffers = getattr(chunk, "buffers", None)  # megatron DDP's contiguous grad buffers (a list there)
        for buf in ddp_buffers if isinstance(ddp_buffers, list) else []:
            grads.append(getattr(buf, "grad_data", None))
    if role.optimizer is not None:
        for opt in getattr(role.optimizer, "chained_optimizers", [role.optimizer]):
            inner = getattr(opt, "optimizer", opt)
            for st in inner.state.values():
                states += [v for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
            for group in getattr(opt, "fp32_from_float16_groups", []) or []:  # master copies of bf16/fp16 params
                states += list(group)
    return {"params": params, "grads": grads, "optimizer": states}


def account(run) -> dict[str, int]:
    """Bytes held after a step, by role and kind; each storage once (first claimant wins, in this order)."""
    seen: set[int] = set()
    out: dict[str, int] = {}

    def claim(label: str, tensors) -> None:
        total = 0
        for ptr, nbytes in _storages(tensors).items():
            if ptr not in seen:
                seen.add(ptr)
                total += nbytes
        out[label] = out.get(label, 0) + total

    roles = run.roles
    for name in ("actor", "critic", "ref", "reward"):
        role = getattr(roles, name)
        if role is None:
            continue
        for kind, tensors in _role_tensors(role).items():
            claim(f"{name} {kind}", tensors)
    engine = run.rollout.engine
    model = getattr(engine, "model", None)
    if model is not None:
        claim("engine params", list(model.parameters()) + list(model.buffers()))
    return {k: v for k, v in out.items() if v}


def _trace(target: str) -> None:
    """Wrap MODULE:QUALNAME to print the resident set and the peak around each call."""
    import functools
    import importlib

    module, qualname = target.split(":")
    owner = importlib.import_module(module)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def traced(*a, **kw):
        before = _status("VmRSS")
        _reset_peak()
        try:
            return fn(*a, **kw)
        finally:
            print(f"  [trace] {qualname}: {before / GB:.2f} -> {_status('VmRSS') / GB:.2f} GB "
                  f"(peak {_status('VmHWM') / GB:.2f})", flush=True)
    setattr(owner, name, traced)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--response", type=int, default=64)
    p.add_argument("--steps", type=int, default=2, help="PPO steps (phase peaks are the max over steps)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--micro", type=int, default=None, help="actor and critic ppo_micro_batch_size_per_gpu "
                   "(default: the whole mini-batch in one micro-batch)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="extra megappo override")
    p.add_argument("--trace", action="append", default=[], metavar="MODULE:QUALNAME",
                   help="print the resident set around every call of this function (repeatable), e.g. "
                        "megappo.rollout.hf.engine:HFEngine.generate")
    p.add_argument("--malloc-trim", action="store_true", help="glibc malloc_trim(0) after every phase")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    for target in args.trace:
        _trace(target)

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch

    torch.set_num_threads(args.threads)
    os.environ["MEGAPPO_CPU_THREADS"] = str(args.threads)
    from bench_ppo_iteration import QWEN, REWARD_FN, make_models, make_prompts, megappo_overrides, write_parquet
    from megappo.testing.dist import free_port
    from transformers import AutoTokenizer

    os.environ.setdefault("MASTER_PORT", str(free_port()))
    size = dict(model=dict(QWEN, hidden_size=args.hidden, num_hidden_layers=args.layers,
                           num_attention_heads=max(4, args.hidden // 64), num_key_value_heads=2,
                           intermediate_size=args.intermediate),
                batch=args.batch, response=args.response, epochs=1)
    work = tempfile.mkdtemp(prefix="megappo_bench_memory_")
    models = make_models(work, size)
    n = models["params"]["policy"]  # the Hugging Face model's (megatron pads the vocabulary)
    tok = AutoTokenizer.from_pretrained(models["paths"]["policy"])
    contents, _ = make_prompts(tok, size["batch"] * (args.steps + 1))
    data = write_parquet(f"{work}/prompts.parquet", contents)
    with open(f"{work}/bench_reward.py", "w") as f:
        f.write(REWARD_FN)
    overrides = megappo_overrides(models, size, args.steps - 1, work, data, f"{work}/bench_reward.py", False)
    overrides += ["trainer.logger=[]", *args.override]
    if args.micro:
        overrides += [f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro}",
                      f"critic.ppo_micro_batch_size_per_gpu={args.micro}"]

    import importlib

    from megappo.config import load_config

    fit_module = importlib.import_module("megappo.trainer.loop")
    metrics_module = importlib.import_module("megappo.trainer.metrics")

    cfg = load_config(None, overrides)
    peaks, captured = PhasePeaks(), {}
    import gc

    gc.collect()
    baseline = _status("VmRSS")
    real_setup, real_step = fit_module.setup, fit_module.train_step

    def setup(c):
        return peaks.measure("setup", real_setup, c)

    def train_step(run, source, step, stop=None):
        if "accounted" not in captured:
            captured["after_setup"] = _status("VmRSS")
        out = real_step(run, source, step, stop)
        if "accounted" not in captured:
            captured["accounted"] = account(run)
            captured["after_step"] = _status("VmRSS")
        return out

    real_call = metrics_module.Timer.__call__
    nested: list[int] = []  # per open phase: the peak of the phases inside it (a reset hides theirs from it)

    def timed(self, phase):
        import contextlib

        @contextlib.contextmanager
        def cm():
            nested.append(0)
            _reset_peak()
            try:
                with real_call(self, phase):
                    yield
            finally:
                if args.malloc_trim:
                    import ctypes

                    ctypes.CDLL("libc.so.6").malloc_trim(0)
                peak = max(_status("VmHWM"), nested.pop())
                if nested:
                    nested[-1] = max(nested[-1], peak)
                peaks.peak[phase] = max(peaks.peak.get(phase, 0), peak)
                peaks.after[phase] = max(peaks.after.get(phase, 0), _status("VmRSS"))
        return cm()

    fit_module.setup, fit_module.train_step = setup, train_step
    metrics_module.Timer.__call__ = timed
    t0, cpu0 = time.perf_counter(), os.times()
    try:
        assert fit_module.fit(cfg) == 0
    finally:
        fit_module.setup, fit_module.train_step = real_setup, real_step
        metrics_module.Timer.__call__ = real_call
    wall, cpu1 = time.perf_counter() - t0, os.times()
    # CPU seconds of the run, user and system (page faults: the price of giving memory back), which a shared
    # machine's load disturbs far less than the wall time
    captured["cpu"] = (cpu1.user - cpu0.user, cpu1.system - cpu0.system)
    report(n, baseline, peaks, captured, wall, args)


def report(n: int, baseline: int, peaks: PhasePeaks, captured: dict, wall: float, args) -> None:
    per = lambda b: b / n  # noqa: E731 - bytes per actor parameter
    print(f"bench_memory: Qwen2 hidden {args.hidden} x {args.layers} layers, {n / 1e6:.1f}M parameters, fp32, "
          f"batch {args.batch} x {args.response} tokens, {args.steps} steps in {wall:.0f} s (CPU: user "
          f"{captured['cpu'][0]:.1f} s, system {captured['cpu'][1]:.1f} s)")
    print(f"\n  {'phase':<22}{'peak GB':>10}{'B/param':>10}{'after GB':>10}")
    order = ["setup"] + [k for k in peaks.peak if k not in ("setup", "step")] + ["step"]
    for k in order:
        if k in peaks.peak:
            print(f"  {k:<22}{peaks.peak[k] / GB:>10.2f}{per(peaks.peak[k]):>10.1f}{peaks.after[k] / GB:>10.2f}")
    acc = captured.get("accounted", {})
    after = captured.get("after_step", 0)
    print(f"\n  held after the first step{'':<6}{'GB':>8}{'B/param':>10}")
    rows = [("before setup (Python, torch, megatron)", baseline), *sorted(acc.items())]
    for label, b in rows:
        print(f"  {label:<38}{b / GB:>8.2f}{per(b):>10.1f}")
    rest = after - baseline - sum(acc.values())
    print(f"  {'the rest (nothing above holds it)':<38}{rest / GB:>8.2f}{per(rest):>10.1f}")
    print(f"  {'resident after the first step':<38}{after / GB:>8.2f}{per(after):>10.1f}")
    top = max(peaks.peak.values())
    print(f"\n  run peak {top / GB:.2f} GB = {per(top):.1f} bytes per parameter (target <= 48)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": n, "baseline": baseline, "peak": peaks.peak, "after": peaks.after,
                       "accounted": acc, "after_step": after, "wall": wall,
                       "cpu_user_s": captured["cpu"][0], "cpu_system_s": captured["cpu"][1]}, f, indent=1)


if __name__ == "__main__":
    main()
