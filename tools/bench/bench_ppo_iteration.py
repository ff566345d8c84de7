"""Seconds per PPO iteration, by phase: megappo's trainer beside TRL's PPO trainer, measured in one run.

Both sides train the same random-weight Qwen2 (megappo.testing's factory and its 512-token tokenizer, fp32, no
download) on the same prompts (fixed-length chat prompts of tokenizer words), with the same batch, response length
(every response runs to full length: megappo ignores EOS, TRL has no stop token) and PPO epochs, each side on
--threads torch threads (default 1; megappo through MEGAPPO_CPU_THREADS):

- megappo: `megappo train` in a subprocess (world size 1, so megatron's global state never meets TRL's), GAE with a
  critic, the KL penalty in the reward, a length-based custom reward function; per-phase means of the
  `timing/<phase>_s` values of `metrics.jsonl`, the first step dropped as warm-up.
- TRL: `trl.experimental.ppo.PPOTrainer.train()` (trl==1.12.0, the last release with PPO) with a reference model
  and sequence-classification value and reward models of the same architecture; the step time comes from a
  callback at each step end, and rollout/ref/values/reward from timers wrapped around the trainer module's own
  `batch_generation`, `forward`, `get_reward` and `gc.collect` (TRL calls it twice a step, and on a tiny
  model that is most of TRL's step); "update" is the rest (GAE, the fused actor+critic backward and
  step, logging). The first step is dropped as warm-up. TRL takes old log-probs from the sampling logits, so it
  has no old_log_prob or weight_sync phase; it scores with a reward model where megappo calls a function
  (--megappo-reward-model gives megappo the same reward model).

Sizes: "tiny" (hidden 32, 2 layers, batch 8, 16-token responses: megappo's fixed per-step overheads by phase),
"compute" (about 30M parameters, batch 16, 64-token responses; the target is megappo <= 0.5x TRL's step time) and
"varlen" (3.4M parameters, batch 16, variable-length responses up to 512 tokens: EOS is honoured on both sides and
the policy's EOS row is shaped (`shape_eos`) for lognormal lengths, median ~50; megappo runs packed micro-batches,
TRL pads every batch to its longest response; the target is megappo <= 0.6x TRL's step time). Not in the default
--sizes: shaping the EOS row samples a few 512-token probes first (minutes on CPU).

    pip install -e ".[bench]"        # trl==1.12.0 (check that torch stays at your version)
    python tools/bench/bench_ppo_iteration.py [--sizes tiny,compute] [--steps 3] [--threads 1] [--skip-trl]
        [--repeats 5]

Timings on a shared machine swing with its load. --repeats N runs each side N times, interleaved (the side that
goes first alternates) so that a change of load hits both, and prints the median of each phase over the N runs;
every run's step time is printed beside the machine's load (/proc/loadavg) before and after it.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import types

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

QWEN = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
SIZES = {
    "tiny": dict(model=dict(QWEN, hidden_size=32, num_hidden_layers=2, intermediate_size=64),
                 batch=8, response=16, epochs=1),
    "compute": dict(model=dict(QWEN, hidden_size=512, num_hidden_layers=10, num_attention_heads=8,
                               intermediate_size=1536), batch=16, response=64, epochs=1),
    # variable lengths: EOS honoured on both sides, the policy's EOS row set so that response lengths are lognormal
    # (median 48, sigma 1, up to 512; see shape_eos); megappo packs (use_remove_padding), TRL pads to the longest
    "varlen": dict(model=dict(QWEN, hidden_size=256, num_hidden_layers=4, intermediate_size=768,
                              max_position_embeddings=1024), batch=16, response=512, epochs=1,
                   eos=dict(median=48.0, sigma=1.0)),
}
PROMPT_WORDS = 12  # content words per prompt: one token each, so every prompt has the same token count
MEGAPPO_PHASES = ("rollout", "weight_sync", "reward", "reward_model", "ref", "old_log_prob", "values", "adv",
                  "update_critic", "update_actor")
TRL_PHASES = ("rollout", "ref", "values", "reward_model", "gc.collect", "update")
REWARD_FN = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """A length-based score: the benchmark times PPO, not the task."""
    return len(solution_str) / 100.0
'''


# ------------------------------------------------------------------------------------------------------------
# shared inputs: models, prompts, Parquet
# ------------------------------------------------------------------------------------------------------------
def make_models(work: str, size: dict) -> dict:
    """Policy (causal LM) and value/reward (sequence classification) HF directories; returns paths and counts."""
    from megappo.testing import make_hf_model
    from safetensors import safe_open

    paths = {
        "policy": make_hf_model("qwen2", f"{work}/policy", seed=0, **size["model"]),
        "value": make_hf_model("qwen2", f"{work}/value", seq_cls=True, seed=1, **size["model"]),
        "reward": make_hf_model("qwen2", f"{work}/reward", seq_cls=True, seed=2, **size["model"]),
    }
    counts = {}
    for role, path in paths.items():
        with safe_open(f"{path}/model.safetensors", "pt") as f:
            counts[role] = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())
    return {"paths": paths, "params": counts}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def make_prompts(tok, n: int, seed: int = 0) -> tuple[list[str], list[list[int]]]:
    """`n` user messages of PROMPT_WORDS single-token words, and their chat-templated token ids (equal lengths)."""
    from megappo.testing.tokenizer import _WORDS

    words = [w for w in _WORDS if len(tok.encode(" " + w, add_special_tokens=False)) == 1]
    rng = random.Random(seed)
    contents, ids = [], []
    while len(contents) < n:
        text = "it " + " ".join(rng.choice(words) for _ in range(PROMPT_WORDS))
        templated = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=False)
        tokens = tok(templated, add_special_tokens=False)["input_ids"]
        if not ids or len(tokens) == len(ids[0]):
            contents.append(text)
            ids.append(tokens)
    return contents, ids


def write_parquet(path: str, contents: list[str]) -> str:
    """The prompts as a Parquet file in verl's schema (data_source "bench", scored by the custom function)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "bench", "prompt": [{"role": "user", "content": c}], "ability": "bench",
             "reward_model": {"style": "rule", "ground_truth": ""}, "extra_info": {"index": i}}
            for i, c in enumerate(contents)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def shape_eos(policy_dir: str, prompt_ids: list[list[int]], median: float, sigma: float, max_len: int,
              seed: int = 0, probe_tokens: int = 24, rounds: int = 4) -> dict:
    """Set the policy's EOS row of `lm_head` so that sampled response lengths are about lognormal(median, sigma).

    Each prompt p draws a target length L_p (lognormal, clipped to 8..max_len). Sampling `probe_tokens` tokens
    per prompt from the unchanged model gives the final hidden states h_t (which the EOS row does not change);
    the EOS row w is the least-squares fit of w . h_t = logit(1 / L_p) + logsumexp(other logits at t) - shift, a
    per-token EOS probability of about 1 / L_p on prompt p's responses. The fit's per-token noise shortens the
    responses (the hazard is convex in it), so `shift` is bisected over `rounds` sampled probes until their median
    length is the target's. Both trainers sample from this model and stop at EOS, so they see the same length
    distribution. Returns a summary (target and probe lengths)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(policy_dir)
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
    eos = tok.eos_token_id
    g = torch.Generator().manual_seed(seed)
    n = len(prompt_ids)
    target = torch.exp(torch.randn(n, generator=g) * sigma + torch.log(torch.tensor(median))).clamp(8, max_len)
    ids = torch.tensor(prompt_ids)  # equal lengths (make_prompts)
    ones = torch.ones_like(ids)
    with torch.no_grad():
        torch.manual_seed(seed)
        out = model.generate(ids, attention_mask=ones, do_sample=True, max_new_tokens=probe_tokens,
                             min_new_tokens=probe_tokens, suppress_tokens=[eos], pad_token_id=eos)
        hidden = model(out, output_hidden_states=True).hidden_states[-1][:, ids.shape[1] - 1:-1]  # [n, k, H]
        logits = model.lm_head(hidden)
        others = torch.cat([logits[..., :eos], logits[..., eos + 1:]], -1).logsumexp(-1)  # [n, k]
        q = (1.0 / target).unsqueeze(1)
        goals = (torch.log(q / (1 - q)) + others).reshape(-1)
        feats = hidden.reshape(-1, hidden.shape[-1])
        gram = feats.T @ feats + 1e-3 * torch.eye(feats.shape[1])

        def probe(shift: float) -> torch.Tensor:
            model.lm_head.weight[eos] = torch.linalg.solve(gram, feats.T @ (goals - shift))
            torch.manual_seed(seed + 1)
            resp = model.generate(ids, attention_mask=ones, do_sample=True, max_new_tokens=max_len,
                                  eos_token_id=eos, pad_token_id=eos)[:, ids.shape[1]:]
            hit = resp == eos
            return torch.where(hit.any(1), hit.float().argmax(1) + 1, torch.full((n,), resp.shape[1])).float()

        lo, hi = -2.0, 8.0
        for _ in range(rounds):
            mid = (lo + hi) / 2
            lengths = probe(mid)
            lo, hi = (mid, hi) if lengths.median() < target.median() else (lo, mid)
        shift = (lo + hi) / 2
        lengths = probe(shift)
    model.save_pretrained(policy_dir)
    return {"target_median": round(float(target.median()), 1), "probe_median": float(lengths.median()),
            "probe_min": int(lengths.min()), "probe_max": int(lengths.max()),
            "probe_mean": round(float(lengths.mean()), 1), "shift": shift}


# ------------------------------------------------------------------------------------------------------------
# TRL
# ------------------------------------------------------------------------------------------------------------
def _timed(fn, timers: dict, phase_of):
    """Wrap `fn` so that each call adds its seconds to timers[phase_of(args)]."""
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            phase = phase_of(args)
            if phase is not None:
                timers[phase] = timers.get(phase, 0.0) + time.perf_counter() - t0
    return wrapper


def _trl_step_recorder(timers: dict, steps: list):
    """A TrainerCallback that closes one step's record (wall time and phase timers) at each step end."""
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()
            timers.clear()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            steps.append({"step": now - self.t, **timers})
            self.t = now
            timers.clear()

    return StepTimes()


def trl_config(out_dir: str, size: dict, steps: int):
    """TRL's PPOConfig for `steps` iterations at `size`, on CPU in fp32, no extras (sample generations, saving)."""
    from trl.experimental.ppo import PPOConfig

    return PPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=size["batch"], gradient_accumulation_steps=1, num_mini_batches=1,
        num_ppo_epochs=size["epochs"], total_episodes=size["batch"] * steps, response_length=size["response"],
        local_rollout_forward_batch_size=size["batch"], stop_token="eos" if "eos" in size else None,
        temperature=1.0, num_sample_generations=0,
        learning_rate=1e-6, kl_coef=0.001, report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
        dataloader_num_workers=0, seed=0)


def run_trl(models: dict, size: dict, steps: int, work: str, threads: int) -> dict:
    """Train TRL's PPO for 1 warm-up + `steps` iterations; returns per-phase mean seconds of the measured ones."""
    import torch
    import trl.experimental.ppo.ppo_trainer as ppo_mod
    from datasets import Dataset
    from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                              PrinterCallback)

    torch.set_num_threads(threads)
    paths = models["paths"]
    tok = AutoTokenizer.from_pretrained(paths["policy"], padding_side="left")
    _, ids = make_prompts(tok, size["batch"] * (steps + 1))
    data = Dataset.from_dict({"input_ids": ids})
    load_lm = lambda: AutoModelForCausalLM.from_pretrained(paths["policy"], dtype=torch.float32)  # noqa: E731
    load_cls = lambda p: AutoModelForSequenceClassification.from_pretrained(  # noqa: E731
        p, num_labels=1, dtype=torch.float32)
    trainer = ppo_mod.PPOTrainer(
        args=trl_config(f"{work}/trl_out", size, steps + 1), processing_class=tok, model=load_lm(),
        ref_model=load_lm(), reward_model=load_cls(paths["reward"]), value_model=load_cls(paths["value"]),
        train_dataset=data, eval_dataset=data)
    trainer.remove_callback(PrinterCallback)
    timers, records = {}, []
    trainer.add_callback(_trl_step_recorder(timers, records))
    originals = {n: getattr(ppo_mod, n) for n in ("batch_generation", "forward", "get_reward")}
    ppo_mod.batch_generation = _timed(originals["batch_generation"], timers, lambda a: "rollout")
    ppo_mod.forward = _timed(originals["forward"], timers,
                             lambda a: "ref" if a[0] is trainer.ref_model else None)
    ppo_mod.get_reward = _timed(originals["get_reward"], timers,
                                lambda a: "reward_model" if a[0] is trainer.reward_model else "values")
    ppo_mod.gc = types.SimpleNamespace(collect=_timed(gc.collect, timers, lambda a: "gc.collect"))
    try:
        trainer.train()
    finally:
        for name, fn in originals.items():
            setattr(ppo_mod, name, fn)
        ppo_mod.gc = gc
    measured = records[1:]
    out = {k: sum(r.get(k, 0.0) for r in measured) / len(measured) for k in ("step", *TRL_PHASES[:-1])}
    out["update"] = out["step"] - sum(out[k] for k in TRL_PHASES[:-1])
    out["steps"] = len(measured)
    return out


# ------------------------------------------------------------------------------------------------------------
# megappo
# ------------------------------------------------------------------------------------------------------------
def megappo_overrides(models: dict, size: dict, steps: int, work: str, data: str, reward_py: str,
                      use_rm: bool) -> list[str]:
    """The `megappo train` key=value overrides matching TRL's run (1 warm-up + `steps` steps)."""
    arr, b = "actor_rollout_ref", size["batch"]
    rm = ["reward_model.enable=true", f"reward_model.path={models['paths']['reward']}"] if use_rm else []
    return [*rm,
        f"{arr}.model.path={models['paths']['policy']}", f"{arr}.model.dtype=float32",
        f"data.train_files={data}", f"data.val_files={data}", f"data.train_batch_size={b}",
        f"data.max_response_length={size['response']}", "data.max_prompt_length=64",
        f"{arr}.actor.ppo_mini_batch_size={b}", f"{arr}.actor.ppo_epochs={size['epochs']}",
        f"{arr}.rollout.ignore_eos={'false' if 'eos' in size else 'true'}", f"{arr}.rollout.temperature=1.0",
        "algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true",
        f"custom_reward_function.path={reward_py}", "custom_reward_function.name=compute_score",
        "trainer.device=cpu", "trainer.nnodes=1", "trainer.n_gpus_per_node=1",
        f"trainer.total_training_steps={steps + 1}", f"trainer.default_local_dir={work}/megappo_run",
        "trainer.logger=[console]", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.save_freq=-1", "trainer.resume_mode=disable",
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_megappo(models: dict, size: dict, steps: int, work: str, extra: list[str], use_rm: bool,
                threads: int) -> dict | str:
    """`megappo train` in a world-1 subprocess on 1 thread; per-phase means of metrics.jsonl, or why it failed."""
    if importlib.util.find_spec("megappo.trainer.loop") is None:
        return "megappo trainer not available (megappo/trainer/loop.py is missing)"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models["paths"]["policy"])
    contents, _ = make_prompts(tok, size["batch"] * (steps + 1))
    data = write_parquet(f"{work}/prompts.parquet", contents)
    reward_py = f"{work}/bench_reward.py"
    with open(reward_py, "w") as f:
        f.write(REWARD_FN)
    env = dict(os.environ, MEGAPPO_CPU_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads), RANK="0", LOCAL_RANK="0",
               WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    cmd = [sys.executable, "-m", "megappo.cli", "train",
           *megappo_overrides(models, size, steps, work, data, reward_py, use_rm), *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not os.path.exists(f"{work}/megappo_run/metrics.jsonl"):
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
        return f"megappo train failed (exit {proc.returncode}):\n{tail}"
    from megappo.trainer.metrics import read_steps

    return summarize_megappo(read_steps(f"{work}/megappo_run"), wall)


def summarize_megappo(rows: list[dict], wall: float) -> dict | str:
    """Means over the steps after the first of every `timing/<phase>_s` value (and perf/tokens_per_s)."""
    measured = rows[1:]
    if not measured:
        return f"megappo wrote {len(rows)} step(s) to metrics.jsonl; need at least 2 (1 is warm-up)"
    keys = sorted({k for r in measured for k in r if k.startswith("timing/") and k.endswith("_s")})
    out = {k[len("timing/"):-2]: sum(r.get(k, 0.0) for r in measured) / len(measured) for k in keys}
    tps = [r["perf/tokens_per_s"] for r in measured if "perf/tokens_per_s" in r]
    out["tokens_per_s"] = sum(tps) / len(tps) if tps else float("nan")
    out["steps"], out["wall"] = len(measured), wall
    return out


# ------------------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------------------
def _fmt(x) -> str:
    return f"{x:10.4f}" if isinstance(x, (int, float)) else f"{'-':>10}"


def _row(name: str, m, t) -> str:
    ratio = f"{m / t:8.2f}x" if isinstance(m, float) and isinstance(t, float) and t > 0 else f"{'':>9}"
    return f"  {name:<24}{_fmt(m)}{_fmt(t)} {ratio}"


def print_table(name: str, size: dict, models: dict, prompt_len: int, mega, trl) -> None:
    p = models["params"]
    print(f"\n== {name}: Qwen2 policy {p['policy']:,} params (value {p['value']:,}, reward {p['reward']:,}), "
          f"{size['batch']} prompts x ({prompt_len} prompt + {size['response']} response) tokens, "
          f"{size['epochs']} PPO epoch(s) ==")
    if isinstance(mega, str):
        print(f"  megappo: {mega}")
    if isinstance(trl, str):
        print(f"  TRL: {trl}")
    m = mega if isinstance(mega, dict) else {}
    t = trl if isinstance(trl, dict) else {}
    print(f"  {'phase (s / iteration)':<24}{'megappo':>10}{'TRL':>10}  megappo/TRL")
    extra = sorted(set(m) - set(MEGAPPO_PHASES) - {"step", "tokens_per_s", "steps", "wall", "runs"})
    for ph in (*MEGAPPO_PHASES, *extra):
        print(_row(ph, m.get(ph), t.get(ph)))
    upd = m["update_actor"] + m.get("update_critic", 0.0) if "update_actor" in m else None
    print(_row("update (actor+critic)", upd, t.get("update")))
    print(_row("gc.collect (TRL)", None, t.get("gc.collect")))
    print(_row("step (total)", m.get("step"), t.get("step")))
    print(_row("step, TRL minus gc", m.get("step"), t["step"] - t["gc.collect"] if t else None))
    if m:
        print(f"  megappo: perf/tokens_per_s {m['tokens_per_s']:.1f}; {m['steps']:g} measured step(s); "
              f"subprocess wall {m['wall']:.1f} s (startup and warm-up step included)")
    if t:
        print(f"  TRL: {t['steps']:g} measured step(s); 'update' = step - rollout - ref - values - reward - gc "
              f"(GAE, one fused actor+critic forward/backward/step, logging)")


def bench_size(name: str, args) -> None:
    size = SIZES[name]
    with tempfile.TemporaryDirectory(prefix=f"megappo_bench_ppo_{name}_") as work:
        models = make_models(work, size)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(models["paths"]["policy"])
        prompt_len = len(make_prompts(tok, 1)[1][0])
        if "eos" in size:
            shaped = shape_eos(models["paths"]["policy"], make_prompts(tok, size["batch"] * (args.steps + 1))[1],
                               size["eos"]["median"], size["eos"]["sigma"], size["response"])
            print(f"  {name}: EOS shaped for lognormal response lengths: {shaped}", flush=True)
        sides = {
            "TRL": None if args.skip_trl else lambda d: trl_or_reason(models, size, args.steps, d, args.threads),
            "megappo": None if args.skip_megappo else lambda d: run_megappo(
                models, size, args.steps, d, args.megappo_override, args.megappo_reward_model, args.threads),
        }
        runs: dict[str, list] = {side: [] for side in sides}
        for i in range(args.repeats):
            order = list(sides) if i % 2 == 0 else list(sides)[::-1]
            for side in order:
                if sides[side] is not None:
                    os.makedirs(f"{work}/run{i}", exist_ok=True)
                    runs[side].append(_loaded(lambda: sides[side](f"{work}/run{i}")))
        mega = _median(runs["megappo"]) if sides["megappo"] else "skipped (--skip-megappo)"
        trl = _median(runs["TRL"]) if sides["TRL"] else "skipped (--skip-trl)"
        print_table(name, size, models, prompt_len, mega, trl)
        n = args.repeats
        print(f"  {'median of ' + str(n) + ' interleaved runs per side' if n > 1 else 'one run per side'}; "
              "per run: step seconds, /proc/loadavg (1, 5, 15 min) before -> after (other processes slow both "
              "sides; compare runs on a quiet machine):")
        for i in range(n):
            got = {side: runs[side][i] for side in sides if runs[side]}
            ratio = [r["step"] for r, _, _ in got.values() if isinstance(r, dict)]
            print(f"    run {i + 1}: " + "; ".join(
                f"{side} {_fmt_step(r)}, load {before} -> {after}" for side, (r, before, after) in got.items())
                + (f"; megappo/TRL {ratio[1] / ratio[0]:.2f}x" if len(ratio) == 2 else ""), flush=True)


def _loaded(fn) -> tuple:
    """`fn()`'s result with /proc/loadavg's load averages before and after it."""
    before = _loadavg()
    return fn(), before, _loadavg()


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:  # not Linux
        return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _fmt_step(result) -> str:
    return f"{result['step']:.2f} s" if isinstance(result, dict) else "failed"


def _median(runs: list) -> dict | str:
    """The median of each number over the runs that succeeded (the first failure's reason when none did)."""
    good = [r for r, _, _ in runs if isinstance(r, dict)]
    if not good:
        return runs[0][0]
    out = {k: statistics.median(r[k] for r in good) for k in good[0] if all(k in r for r in good)}
    out["runs"] = len(good)
    return out


def trl_or_reason(models: dict, size: dict, steps: int, work: str, threads: int) -> dict | str:
    if importlib.util.find_spec("trl") is None:
        return "trl is not installed: pip install -e \".[bench]\" (or pip install trl==1.12.0 --no-deps plus " \
               "accelerate, datasets), then check that torch kept its version"
    return run_trl(models, size, steps, work, threads)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="tiny,compute", help="comma-separated, of: " + ", ".join(SIZES))
    p.add_argument("--steps", type=int, default=3, help="measured iterations per side (after 1 warm-up)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each side (default 1)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per side, interleaved; the table shows each phase's median over them (default 1)")
    p.add_argument("--skip-trl", action="store_true")
    p.add_argument("--skip-megappo", action="store_true")
    p.add_argument("--megappo-reward-model", action="store_true",
                   help="megappo scores with the same reward model as TRL instead of the length function")
    p.add_argument("--megappo-override", action="append", default=[], metavar="KEY=VALUE",
                   help="extra `megappo train` override (repeatable), e.g. reward_model.backend=serial")
    args = p.parse_args()
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        p.error(f"unknown size(s) {unknown}; choose from {list(SIZES)}")
    if args.steps < 1 or args.repeats < 1:
        p.error("--steps and --repeats must be at least 1")
    for name in sizes:
        bench_size(name, args)


if __name__ == "__main__":
    main()
