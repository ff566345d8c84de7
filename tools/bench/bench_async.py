"""Sync vs one-step-off PPO on a 2-core CPU: throughput, trainer idle share and reward, side by side in one run.

Every configuration runs `python -m megappo.cli train --config recipes/cpu/tiny_ppo.yaml key=value ...` (the main
job's PPO: GAE critic, KL in the reward, lr 1e-3, two mini-batches a step) in a fresh temporary directory, one
subprocess per run, and is summarised from its `metrics.jsonl`:

- samples/s: samples trained per second over the steady-state steps (steps 2..N: setup and step 1, which in
  one_step_off also generates its own batch, are left out): batch x (N - 1) / the sum of their timing/step_s (the
  runs validate, save and log nothing else between steps, so that is their wall time);
- idle: the trainer's idle share of those steps: timing/wait_for_rollout_s / timing/step_s for the asynchronous
  modes; for sync, where training stops while the engine generates, timing/rollout_s / timing/step_s;
- gen / train: seconds per step generating and training. sync: timing/rollout_s and the rest of the step. The
  asynchronous modes: the engine's time per batch, hidden behind training (from timing/rollout_overlap = 1 -
  wait / generation time), and the step minus the wait;
- reward: the mean reward/mean of the last --reward-steps steps, after the same number of samples in every
  configuration, with its binomial standard error (the sampling noise of that mean). In one_step_off a step's
  samples come from the policy one update older, so this lags by a step; "val reward" is therefore also given: the
  final policy's reward on 512 held-out prompts at temperature 1 (validation after the last step, outside the
  timed steps). megappo runs are deterministic: the repeats of one configuration log the same rewards, only their
  timings differ;
- speedup: samples/s over the best sync's (sync runs with --sync-threads trainer threads, 1 and 2 by default;
  "best" is the one with the higher median samples/s), per round, then median [min-max];
- CPU us/others: cores busy on average during the run (/proc/stat and getrusage): the run's own processes
  (startup included) / every other process on the machine. one_step_off needs both cores: "others" says how much of
  the second one it had.

Modes (`MODES`; a new async_training.mode is one more entry): sync (the engine in the trainer's process, on its
threads), one_step_off (the engine in a process of its own with rollout.engine_kwargs.threads=1, generating step
k+1's batch while step k trains on the other core with one trainer thread) and fully_async (the same placement; a
producer generates ahead, weights synced every 2 steps, half a window ahead, partial rollouts).

Workload. The issue asks for generation and training of similar cost and response lengths that vary (lognormal,
EOS honoured). The built-in task digit_max (`max 3 9 1 4 =` -> `9`, reward 1 for exactly the largest digit;
megappo/tasks/synthetic.py) gives the prompts, the tokenizer and the rule reward (`prepare_task` writes them; the
runs read them as data.train_files with data.synthetic.name=null). Its own warm start only teaches two-token
answers, so this script warm-starts a fresh Qwen2 of the same vocabulary (--hidden, --layers) on
`prompt, answer, Ġ x L, EOS`, L = round(lognormal(log --median, --sigma)) clipped to the response budget, with
digit_max's label smoothing on the answer (the policy samples the right digit ~1/4 of the time: PPO has something
to learn). "Ġ" is a space, which the reward strips, so the reward does not depend on the length (the answer comes
first: a long or truncated response scores as its first token does), and PPO has no reason to change the lengths
beyond noise (the KL penalty, kl_coef 0.3, holds them near the warm start's). The model learns the stopping hazard
from the teacher-forced lengths, so at temperature 1 it stops by itself after a lognormal-like number of tokens:
EOS is honoured by the engine, nothing is forced; the header prints the sampled length quantiles beside the
target's. Why not a random model with a biased EOS logit: its stopping is memoryless (geometric lengths, mode at
the first token) and it has no reward to learn, so "equal reward" would say nothing. The warm start (~1 min) is
cached in the temp directory by its parameters (--rebuild redoes it).

On CPU both phases cost per token: the HF engine samples each row with its own generator (per-row Python) and runs
every decode step over the whole forward batch until its longest row ends, and training (micro-batches packed by
token count, actor.use_dynamic_bsz with a 1024-token budget, so short responses cost little padding) pays for
megatron's 1024-wide padded vocabulary at every token. Long-tailed lengths (sigma 0.9, up to 128 tokens) make
generation run to ~the batch's longest response while training pays for the mean: that puts generation near half
of a sync step. The header prints the measured split.

Three workloads (`WORKLOADS`): "balanced" (responses up to --max-response tokens), "gen_heavy" (GRPO, 4 samples
of 16 prompts, no critic and no reference, on a model of its own warm-started on a longer tail, --gen-median and
--gen-sigma up to --gen-response tokens: generation is at least half of a sync step, 54% measured; each sync run
prints its share) and "tiny_gen" (the balanced model and prompts with
data.max_response_length=--tiny-response, 2: the answer and one more token, so generation is ~15% of a sync step
and one_step_off's cost against sync is mostly its overhead: weight sync into the engine's process, hand-over of
the batch). The reward is unchanged (the answer is the first token).

Reward gap (--seeds 1,2,3,...): every configuration runs once per seed (data.seed: prompt order and every sample's
draw; the critic head's initialisation), and each asynchronous mode's reward minus the best sync's is paired by
seed. Staleness (a step's samples come from the policy one update older) lowers it on every seed: a mean gap beyond
two standard errors; noise gives gaps of both signs, as large as sync's own seed-to-seed spread.

TRL (--trl): TRL 1.12's PPO trainer (`trl.experimental.ppo.PPOTrainer`, the timers of
tools/bench/bench_ppo_iteration.py) on the same workload: the same warm-started policy and reference, a value
model with the policy's backbone and a fresh head (as megappo's critic), the same prompts, batch, two mini-batches,
one PPO epoch, lr, KL coefficient, temperature 1 and stop at EOS, and the same rule reward (digit_max's
`synthetic_reward` on the decoded response, wrapped as the reward "model" TRL's get_reward calls). TRL has no
asynchronous mode; it runs with each --sync-threads count and its best is printed beside megappo's best sync.
Differences that remain: TRL generates with HF `generate` (batched sampling) and updates actor and critic in one
fused backward; its old log-probs come from the sampling logits.

    python tools/bench/bench_async.py [--quick] [--repeats 2] [--steps 14] [--workloads balanced,gen_heavy,tiny_gen]
        [--modes sync,one_step_off,fully_async] [--sync-threads 1,2] [--seeds 1,2,3] [--trl] [--profile]
        [--json out.json]

--profile runs one more one_step_off "balanced" run under py-spy (in the venv; --subprocesses, so the engine's
child process too) and prints each process's CPU seconds by phase (trainer: megappo/trainer/phases.py's phases;
engine: model forward, per-row sampling, weight loading) and its hottest frames.

Timings on a shared machine swing with its load (one_step_off needs both cores): runs are interleaved (round-robin
over the configurations, --repeats rounds), every number is the median over repeats with [min-max], each run
reports the other processes' CPU use, and the 1-minute load average is printed around the benchmark. Default run
(2 workloads x 3 configurations x 2 repeats, 14 steps): ~6 minutes on 2 cores, ~10 with --trl --profile.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import importlib.util
import json
import math
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_async_trl import cpu_snapshot as _cpu_snapshot, cpu_used as _cpu_used, run_trl  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE_RECIPE = os.path.join(REPO, "recipes", "cpu", "tiny_ppo.yaml")
ARR = "actor_rollout_ref"
WORKLOAD_FORMAT = 6  # bump when build_workload writes something else for the same parameters (cached models rebuild)
ANSWER_WEIGHT = 10.0  # warm start: the answer's loss against the ~25 length tokens' (else the rule is learnt slowly)
KL_COEF = 0.3  # in-reward KL coefficient of every run (TRL's too): keeps the lengths near the warm start's
VAL_PROMPTS = 512  # held-out prompts the final policy is validated on (temperature 1, as the recipe)
TOKEN_BUDGET = 1024  # tokens per packed micro-batch (actor, critic, log-prob passes)

# mode -> overrides beyond the workload's, the trainer threads it runs with (None: --sync-threads, best kept), the
# engine's threads (None: the trainer's own), the speedup target over the best sync
MODES: dict[str, dict] = {
    "sync": dict(overrides=[], trainer_threads=None, engine_threads=None, target=None),
    "one_step_off": dict(overrides=[f"{ARR}.hybrid_engine=false", "async_training.mode=one_step_off"],
                         trainer_threads=(1,), engine_threads=1, target=1.25),
    # two mini-batches a step (require_batches 2 x batch / 2), weights synced every 2 steps, half a window
    # generated ahead (no sample more than one version old), a sync aborts and continues the batch in progress
    "fully_async": dict(overrides=[f"{ARR}.hybrid_engine=false", "async_training.mode=fully_async",
                                   "async_training.require_batches=2", "async_training.trigger_parameter_sync_step=2",
                                   "async_training.staleness_threshold=0.5", "async_training.partial_rollout=true"],
                        trainer_threads=(1,), engine_threads=1, target=1.4),
}
# workload -> its response budget (--max-response or --tiny-response), the target for it, what it shows
# "gen_heavy" is GRPO (4 samples of 16 prompts, no critic, no reference: training is two passes a token, as in most
# LLM RL runs where generation dominates) on a model of its own, warm-started on a longer tail of lengths
# (--gen-median, --gen-sigma, up to --gen-response tokens); measured: generation 54% of a sync step
WORKLOADS: dict[str, dict] = {
    "balanced": dict(response="max", target="speedup",
                     what="generation about as long as training (lognormal lengths)"),
    "gen_heavy": dict(response="gen", target="speedup",
                      what="generation at least half of a sync step (GRPO, a longer tail of lengths)",
                      overrides=["algorithm.adv_estimator=grpo", f"{ARR}.rollout.n=4", "data.train_batch_size=16",
                                 f"{ARR}.actor.ppo_mini_batch_size=8", "algorithm.use_kl_in_reward=false"]),
    "tiny_gen": dict(response="tiny", target="overhead",
                     what="generation negligible: the asynchronous modes' overhead"),
}
PHASES = ("rollout", "wait_for_rollout", "weight_sync", "reward", "ref", "old_log_prob", "values", "adv",
          "update_critic", "update_actor")


# ------------------------------------------------------------------------------------------------------------
# workload: digit_max prompts and reward, a model warm-started to stop after a lognormal number of tokens
# ------------------------------------------------------------------------------------------------------------
def model_spec(args, workload: str) -> dict:
    gen = WORKLOADS[workload]["response"] == "gen"
    return dict(hidden=args.hidden, layers=args.layers, median=args.gen_median if gen else args.median,
                sigma=args.gen_sigma if gen else args.sigma,
                max_response=args.gen_response if gen else args.max_response, warm_steps=args.warm_steps,
                val_prompts=VAL_PROMPTS, seed=0, format=WORKLOAD_FORMAT)


def draw_length(rng: random.Random, spec: dict) -> int:
    """Spaces after the answer: round(lognormal), clipped so that answer, spaces and EOS fit in the response budget."""
    return min(spec["max_response"] - 2, max(0, round(math.exp(rng.gauss(math.log(spec["median"]), spec["sigma"])))))


def build_workload(root: str, spec: dict, rebuild: bool) -> dict:
    """prepare_task's digit_max prompts and tokenizer, and a warm-started model in `root/<hash>/model` (reused)."""
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    out = os.path.join(root, f"megappo_bench_async_{key}")
    done = os.path.join(out, "workload.json")
    if os.path.exists(done) and not rebuild:
        with open(done) as f:
            return json.load(f)
    shutil.rmtree(out, ignore_errors=True)
    import torch
    import transformers
    from megappo.tasks import get_task, prepare_task

    t0 = time.perf_counter()
    files = prepare_task("digit_max", os.path.join(out, "task"), num_val_prompts=spec["val_prompts"],
                         warm_start_steps=0, seed=spec["seed"])
    task = get_task("digit_max")
    tok = transformers.AutoTokenizer.from_pretrained(files.model_dir)
    h = spec["hidden"]  # digit_max's model (task.model), resized
    cfg = transformers.Qwen2Config(**{
        **task.model, "hidden_size": h, "intermediate_size": 2 * h, "num_hidden_layers": spec["layers"],
        "num_attention_heads": max(4, h // 32), "num_key_value_heads": max(2, h // 64),
        "max_position_embeddings": max(256, spec["max_response"] + 64), "vocab_size": len(tok), "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id, "bos_token_id": None})
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec["seed"])
            model, lengths, reward = _warm_start(task, tok, cfg, spec, _held_out(files.val_files))
    finally:
        torch.set_num_threads(before)
    model_dir = os.path.join(out, "model")
    model.save_pretrained(model_dir, safe_serialization=True)
    tok.save_pretrained(model_dir)
    rng = random.Random(1)
    target = [draw_length(rng, spec) + 2 for _ in range(10000)]
    info = dict(model_dir=model_dir, train_files=files.train_files, val_files=files.val_files, spec=spec,
                params=sum(p.numel() for p in model.parameters()), build_s=round(time.perf_counter() - t0, 1),
                sampled=_quantiles(lengths), target=_quantiles(target), warm_reward=reward)
    with open(done, "w") as f:
        json.dump(info, f, indent=1)
    return info


def _quantiles(xs: list) -> dict:
    xs = sorted(xs)
    q = lambda f: xs[int(f * (len(xs) - 1))]  # noqa: E731
    return dict(p10=q(0.1), p50=q(0.5), p90=q(0.9), max=xs[-1], mean=round(sum(xs) / len(xs), 1))


def _held_out(val_files: str) -> set[str]:
    import pyarrow.parquet as pq

    return {row[0]["content"] for row in pq.read_table(val_files).column("prompt").to_pylist()}


def _warm_start(task, tok, cfg, spec: dict, held_out: set[str]):
    """Teacher-forced `prompt, answer, Ġ x L, EOS` (L lognormal), digit_max's label smoothing (0.85) on the answer;
    then 256 temperature-1 samples: the lengths it learned and the reward it starts from (returned)."""
    import torch
    import transformers
    from megappo.tasks import synthetic_reward

    model = transformers.Qwen2ForCausalLM(cfg).float()
    fill, eos, pad = tok.convert_tokens_to_ids("Ġ"), tok.eos_token_id, tok.pad_token_id
    digits = torch.tensor(tok.convert_tokens_to_ids([str(d) for d in range(10)]))
    pools = {a: [c for c in codes if task.prompt(c) not in held_out] for a, codes in task.pools().items()}
    p = len(tok(task.prompt(0))["input_ids"])  # every prompt has this many tokens; the answer is token p
    rng = random.Random(spec["seed"] * 7919 + 3)
    steps, smoothing = spec["warm_steps"], 0.85

    def batch(n: int):
        codes = task.sample(rng, n, pools, distinct=False)
        spaces = [draw_length(rng, spec) for _ in codes]
        x = torch.full((n, p + max(spaces) + 2), pad)
        w = torch.zeros(x.shape)  # weight of each position's next-token NLL: spaces and EOS (the answer apart)
        for i, (c, k) in enumerate(zip(codes, spaces)):
            ids = tok(task.prompt(c))["input_ids"] + [tok.convert_tokens_to_ids(task.answer(c))] + [fill] * k + [eos]
            x[i, :len(ids)] = torch.tensor(ids)
            w[i, p:len(ids) - 1] = 1.0
        return x, w

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    model.train()
    for _ in range(steps):
        x, w = batch(64)
        logq = torch.log_softmax(model(input_ids=x).logits[:, :-1].float(), -1)
        nll = -logq.gather(-1, x[:, 1:, None])[..., 0]
        answer = (1 - smoothing) * nll[:, p - 1] + smoothing * -logq[:, p - 1, digits].mean(-1)
        loss = (ANSWER_WEIGHT * answer.sum() + (nll * w[:, :-1]).sum()) / x.shape[0]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = eos, pad
    codes = task.sample(random.Random(5), 256, pools, distinct=False)
    ids = torch.tensor([tok(task.prompt(c))["input_ids"] for c in codes])
    with torch.no_grad():
        gen = model.generate(ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=spec["max_response"])[:, p:].tolist()
    lengths = [r.index(eos) + 1 if eos in r else len(r) for r in gen]
    reward = statistics.fmean(synthetic_reward(task.data_source, tok.decode(r[:n]), task.answer(c))
                              for r, n, c in zip(gen, lengths, codes))
    return model, lengths, reward


# ------------------------------------------------------------------------------------------------------------
# one megappo run
# ------------------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def overrides(work: dict, max_response: int, batch: int, mode: str, steps: int, out_dir: str) -> list[str]:
    """`megappo train` key=value overrides of one run (on top of recipes/cpu/tiny_ppo.yaml)."""
    o = [
        "data.synthetic.name=null", f"data.train_files={work['train_files']}", f"data.val_files={work['val_files']}",
        f"{ARR}.model.path={work['model_dir']}", f"data.train_batch_size={batch}",
        f"{ARR}.actor.ppo_mini_batch_size={batch // 2}", f"data.max_response_length={max_response}",
        f"{ARR}.actor.use_dynamic_bsz=true", f"{ARR}.actor.ppo_max_token_len_per_gpu={TOKEN_BUDGET}",
        f"critic.ppo_max_token_len_per_gpu={TOKEN_BUDGET}", f"algorithm.kl_ctrl.kl_coef={KL_COEF}",
        "trainer.total_epochs=1000", f"trainer.total_training_steps={steps}", f"trainer.default_local_dir={out_dir}",
        "trainer.logger=[console]", "trainer.val_before_train=false", f"trainer.test_freq={steps}",
        "trainer.save_freq=-1", "trainer.resume_mode=disable", *MODES[mode]["overrides"],
    ]
    if MODES[mode]["engine_threads"] is not None:
        o.append(f"{ARR}.rollout.engine_kwargs.threads={MODES[mode]['engine_threads']}")
    return o


def seed_overrides(seed: int | None) -> list[str]:
    """A run's seeds: data.seed (prompt order, every sample's draw) and the initialisation (the critic's head)."""
    return [] if seed is None else [f"data.seed={seed}", f"{ARR}.actor.megatron.seed={42 + seed}"]


def run_one(work: dict, max_response: int, batch: int, mode: str, threads: int, steps: int, reward_steps: int,
            extra: list[str], profile_to: str | None = None) -> dict:
    """One `megappo train` subprocess (under py-spy when `profile_to`); its summary, or {"error": ...}."""
    out_dir = tempfile.mkdtemp(prefix=f"megappo_bench_async_{mode}_")
    try:
        env = dict(os.environ, MEGAPPO_CPU_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
                   MKL_NUM_THREADS=str(threads), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        cmd = [sys.executable, "-m", "megappo.cli", "train", "--config", BASE_RECIPE,
               *overrides(work, max_response, batch, mode, steps, out_dir), *extra]
        if profile_to:
            cmd = [_py_spy(), "record", "--subprocesses", "--nonblocking", "--format", "raw", "--rate", "100",
                   "--output", profile_to, "--", *cmd]
        cpu0 = _cpu_snapshot()
        proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
        cpu = _cpu_used(cpu0)
        wall = cpu["wall"]
        path = os.path.join(out_dir, "metrics.jsonl")
        if proc.returncode != 0 or not os.path.exists(path):
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
            return {"error": f"megappo train failed (exit {proc.returncode}):\n{tail}"}
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return {**summarize(rows, batch, mode, reward_steps, wall), "cpu_ours": cpu["ours"],
                "cpu_others": cpu["others"]}
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def summarize(rows: list[dict], batch: int, mode: str, reward_steps: int, wall: float) -> dict:
    """The numbers of one run from its metrics.jsonl rows (steady state: every step after the first)."""
    rows = sorted(rows, key=lambda r: r["step"])
    steady = rows[1:]
    if not steady:
        return {"error": f"{len(rows)} step(s) logged; need at least 2"}
    get = lambda r, k: r.get(k) or 0.0  # noqa: E731
    step_s = sum(get(r, "timing/step_s") for r in steady)
    rollout_s = sum(get(r, "timing/rollout_s") for r in steady)
    wait_s = sum(get(r, "timing/wait_for_rollout_s") for r in steady)
    # sync: generating is the trainer's idle time; async: the wait (its rollout phase only hands a ready batch over)
    idle_s = rollout_s if mode == "sync" else wait_s + rollout_s
    gen_s = rollout_s / len(steady)
    if mode != "sync":  # the engine's time per batch, overlapped: rollout_overlap = 1 - waited / generated
        gens = [get(r, "timing/wait_for_rollout_s") / (1 - r["timing/rollout_overlap"]) for r in steady
                if r.get("timing/rollout_overlap") is not None and r["timing/rollout_overlap"] < 1]
        gen_s = statistics.fmean(gens) if gens else float("nan")
    last = rows[-reward_steps:]
    reward = statistics.fmean(get(r, "reward/mean") for r in last)
    val = [v for k, v in rows[-1].items() if k.startswith("val/") and k.endswith("reward_mean") and v is not None]
    keys = sorted({k for r in steady for k in r if k.startswith("timing/") and k.endswith("_s")})
    phases = {k[len("timing/"):-2]: sum(get(r, k) for r in steady) / len(steady) for k in keys}
    if "weight_sync" in phases and "wait_for_rollout" in phases:  # the wait is timed inside the sync phase
        phases["weight_sync"] -= phases["wait_for_rollout"]
    return {
        "samples_per_s": batch * len(steady) / step_s,
        "step_s": step_s / len(steady),
        "idle": idle_s / step_s,
        "gen_share": rollout_s / step_s if mode == "sync" else float("nan"),  # generation's share of a sync step
        "gen_s": gen_s,
        "train_s": (step_s - idle_s) / len(steady),
        "reward": reward,
        "reward_se": math.sqrt(max(reward * (1 - reward), 1e-12) / (batch * len(last))),
        "val_reward": val[0] if val else None,
        "val_se": math.sqrt(max(val[0] * (1 - val[0]), 1e-12) / VAL_PROMPTS) if val else None,
        "length_mean": statistics.fmean(get(r, "response/length_mean") for r in steady),
        "phases": phases,
        "wall": wall,
        "per_step": {k: [round(get(r, f), 4) for r in rows] for k, f in
                     (("reward", "reward/mean"), ("length", "response/length_mean"), ("step_s", "timing/step_s"),
                      ("rollout_s", "timing/rollout_s"), ("wait_s", "timing/wait_for_rollout_s"))},
    }


# ------------------------------------------------------------------------------------------------------------
# py-spy profile of a run: where the trainer and the engine's process spend their samples
# ------------------------------------------------------------------------------------------------------------
def _py_spy() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return here if os.path.exists(here) else (shutil.which("py-spy") or "")


# first matching frame (outermost first) names the category; trainer phases are megappo/trainer/phases.py's
TRAINER_CATEGORIES = (("rollout (wait/hand-over)", ("_wait", "take", "collect")),
                      ("weight_sync", ("sync_weights",)), ("ref", ("ref_log_probs",)),
                      ("old_log_prob", ("old_log_probs",)), ("values", ("values",)),
                      ("update_critic", ("update_critic",)), ("update_actor", ("update_actor",)),
                      ("reward+adv+metrics", ("rule_scores", "make_experience", "token_rewards", "advantages",
                                              "rollout_correction", "step_metrics", "staleness", "log")),
                      ("setup/teardown", ("setup", "teardown", "export_actor", "_synthetic")))
ENGINE_CATEGORIES = (("weights load", ("update_weights", "load_weights")),
                     ("per-row sampling", ("_sample",)), ("model forward", ("_generate_batch",)))


def summarize_profile(path: str, rate: int = 100) -> dict:
    """py-spy raw stacks -> {process: {"busy_s", "categories": {name: s}, "top": [(frame, s)]}}."""
    procs: dict[str, dict] = {}
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = stack.split(";")
            head = frames[0]
            role = ("engine" if "spawn_main" in stack and "megappo/rollout/hf_process" in stack else
                    "trainer" if "megappo.cli" in head or "megappo/cli" in stack else "other")
            funcs = [fr.split(" (")[0].rsplit(".", 1)[-1] for fr in frames[1:]]  # "Class.method (file:line)"
            cats = ENGINE_CATEGORIES if role == "engine" else TRAINER_CATEGORIES
            cat = next((name for name, keys in cats if any(fn in keys for fn in funcs)),
                       "startup (imports)" if "_find_and_load" in funcs else "other")
            d = procs.setdefault(role, {"busy_s": 0.0, "categories": collections.Counter(),
                                        "top": collections.Counter()})
            s = int(count) / rate
            d["busy_s"] += s
            d["categories"][cat] += s
            if len(frames) > 1:
                d["top"][frames[-1]] += s
    return {role: {"busy_s": d["busy_s"], "categories": dict(d["categories"].most_common()),
                   "top": d["top"].most_common(16)} for role, d in procs.items()}


# ------------------------------------------------------------------------------------------------------------
# aggregation and report
# ------------------------------------------------------------------------------------------------------------
def spread(xs: list[float]) -> dict:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _fmt_spread(s: dict, fmt: str = "{:.1f}", pct: bool = False) -> str:
    if s["median"] is None:
        return "-"
    f = (lambda v: fmt.format(100 * v)) if pct else (lambda v: fmt.format(v))  # noqa: E731
    if s["n"] < 2:
        return f(s["median"])
    return f"{f(s['median'])} [{f(s['min'])}-{f(s['max'])}]"


def aggregate(runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    out = {k: spread([r.get(k) for r in ok]) for k in ("samples_per_s", "step_s", "idle", "gen_s", "train_s",
                                                       "reward", "reward_se", "val_reward", "val_se", "length_mean",
                                                       "cpu_ours", "cpu_others")}
    out["phases"] = {}
    for r in ok:
        for k in r["phases"]:
            out["phases"].setdefault(k, spread([x["phases"].get(k) for x in ok]))
    out["errors"] = [r["error"] for r in runs if "error" in r]
    seeds = {r.get("seed") for r in ok}  # runs of one seed log the same rewards; of several, their own
    out["rewards_identical"] = all(len({json.dumps(r["per_step"]["reward"]) for r in ok if r.get("seed") == s}) <= 1
                                   for s in seeds)
    return out


def _pm(agg: dict, key: str, se: str) -> str:
    m = agg[key]["median"]
    return "-" if m is None else f"{m:.3f}+-{agg[se]['median']:.3f}"


def _round_ratios(runs: list[dict], base: list[dict]) -> list[float]:
    """samples/s of each run over the same round's run of `base` (the best sync)."""
    return [a["samples_per_s"] / b["samples_per_s"] for a, b in zip(runs, base)
            if "error" not in a and "error" not in b]


def print_workload_table(name: str, results: dict, order: list[str], best_sync: str | None) -> None:
    print(f"\n== {name}: {WORKLOADS[name]['what']}; median [min-max] over repeats ==")
    base = results.get(best_sync, {}).get("runs", []) if best_sync else []
    head = ("configuration", "samples/s", "speedup", "idle %", "gen s/step", "train s/step", "reward last K",
            "val reward", "len", "CPU us/others")
    rows = []
    for cfg in order:
        agg = results[cfg]["agg"]
        ratios = _round_ratios(results[cfg]["runs"], base)
        speed = _fmt_spread(spread(ratios), "{:.2f}") + "x" if ratios else "-"
        length = agg["length_mean"]["median"]
        cpu = (f"{agg['cpu_ours']['median']:.2f}/{agg['cpu_others']['median']:.2f}"
               if agg["cpu_ours"]["median"] is not None else "-")
        rows.append((cfg, _fmt_spread(agg["samples_per_s"]), speed, _fmt_spread(agg["idle"], "{:.0f}", pct=True),
                     _fmt_spread(agg["gen_s"], "{:.3f}"), _fmt_spread(agg["train_s"], "{:.3f}"),
                     _pm(agg, "reward", "reward_se"), _pm(agg, "val_reward", "val_se"),
                     "-" if length is None or math.isnan(length) else f"{length:.1f}", cpu))
    widths = [max(len(r[i]) for r in rows + [head]) + 2 for i in range(len(head))]
    for r in [head] + rows:
        print("  " + r[0].ljust(widths[0]) + "".join(c.rjust(w) for c, w in zip(r[1:], widths[1:])))
    print("  (reward +- its sampling standard error; val reward: the final policy on the held-out prompts; CPU: cores "
          "busy on average during the run, ours (startup included) / the machine's other processes)")
    for cfg in order:
        agg = results[cfg]["agg"]
        for e in agg["errors"]:
            print(f"    {cfg} error: " + e.replace("\n", "\n      "))
        if agg["samples_per_s"]["n"] and not agg["rewards_identical"]:
            print(f"    {cfg}: the repeats of one seed logged different rewards (reward is their median)")


def print_phases(results: dict, cfgs: list[str]) -> None:
    cfgs = [c for c in cfgs if c in results and results[c]["agg"]["phases"]]  # (TRL's: its own phase names)
    if not cfgs:
        return
    keys = [k for k in PHASES if any(k in results[c]["agg"]["phases"] for c in cfgs)]
    keys += sorted({k for c in cfgs for k in results[c]["agg"]["phases"]} - set(keys) - {"step"})
    w = max(len(c) for c in cfgs) + 3
    print(f"  {'per-phase s/step (median over repeats)':<40}" + "".join(f"{c:>{w}}" for c in cfgs))
    for k in keys + ["step"]:
        vals = [results[c]["agg"]["phases"].get(k, {}).get("median") for c in cfgs]
        print(f"    {k:<38}" + "".join(f"{v:>{w}.3f}" if v is not None else f"{'-':>{w}}" for v in vals))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run (~2 min once the model is cached): 6 steps, "
                   "1 repeat, sync with 1 thread only")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="of: " + ", ".join(WORKLOADS))
    p.add_argument("--modes", default=",".join(MODES), help="of: " + ", ".join(MODES))
    p.add_argument("--sync-threads", default="1,2", help="trainer threads of the sync runs (and TRL's)")
    p.add_argument("--steps", type=int, default=14, help="PPO steps per run (the first is not measured)")
    p.add_argument("--reward-steps", type=int, default=4, help="K: reward = mean reward/mean of the last K steps")
    p.add_argument("--repeats", type=int, default=2, help="runs of every configuration (interleaved)")
    p.add_argument("--batch", type=int, default=64, help="prompts (= samples) per step")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--median", type=float, default=16, help="median spaces after the answer (lognormal)")
    p.add_argument("--sigma", type=float, default=0.9, help="lognormal sigma of the spaces after the answer")
    p.add_argument("--max-response", type=int, default=128, help="response budget of the balanced workload")
    p.add_argument("--tiny-response", type=int, default=2, help="response budget of the tiny_gen workload")
    p.add_argument("--gen-response", type=int, default=512, help="response budget of the gen_heavy workload")
    p.add_argument("--gen-median", type=float, default=8, help="gen_heavy: median spaces after the answer")
    p.add_argument("--gen-sigma", type=float, default=1.8, help="gen_heavy: lognormal sigma of the spaces")
    p.add_argument("--seeds", default="", help="comma-separated data seeds: every configuration runs once per seed "
                   "and repeat, and the reward gap of each asynchronous mode to the best sync is paired by seed "
                   "(staleness or noise); empty: the recipe's seed")
    p.add_argument("--warm-steps", type=int, default=200, help="supervised warm-start steps of the model")
    p.add_argument("--cache-dir", default=tempfile.gettempdir(), help="where the warm-started model is kept")
    p.add_argument("--rebuild", action="store_true", help="warm-start the model again even if cached")
    p.add_argument("--trl", action="store_true", help="also time TRL 1.12's PPO on the same workload")
    p.add_argument("--profile", action="store_true", help="one more one_step_off balanced run under py-spy")
    p.add_argument("--megappo-override", action="append", default=[], metavar="KEY=VALUE",
                   help="extra `megappo train` override for every run (repeatable)")
    p.add_argument("--json", metavar="PATH", help="write every number (and each run's per-step values) here")
    args = p.parse_args()
    if args.quick:
        args.steps, args.repeats, args.reward_steps = 6, 1, 2
        if args.sync_threads == "1,2":
            args.sync_threads = "1"
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    sync_threads = [int(t) for t in args.sync_threads.split(",") if t.strip()]
    for name, got, known in (("workload", workloads, WORKLOADS), ("mode", modes, MODES)):
        if unknown := [x for x in got if x not in known]:
            p.error(f"unknown {name}(s) {unknown}; choose from {list(known)}")
    if args.steps < 2 or not 1 <= args.reward_steps <= args.steps or args.repeats < 1 or args.batch < 2:
        p.error("need --steps >= 2, 1 <= --reward-steps <= --steps, --repeats >= 1, --batch >= 2")
    if args.profile and not _py_spy():
        p.error("--profile needs py-spy (pip install py-spy)")

    load0 = os.getloadavg()[0]
    t_start = time.perf_counter()
    works = {wl: build_workload(args.cache_dir, model_spec(args, wl), args.rebuild) for wl in workloads}
    import torch

    first = next(iter(works.values()))
    print(f"bench_async: torch {torch.__version__}, {os.cpu_count()} CPUs, 1-min load {load0:.1f}; workload model "
          f"Qwen2 hidden {args.hidden} x {args.layers} layers ({first['params']:,} params), batch {args.batch}, "
          f"{args.steps} steps (first not measured), reward over the last {args.reward_steps}")
    q = lambda d: f"p10 {d['p10']} p50 {d['p50']} p90 {d['p90']} max {d['max']} mean {d['mean']}"  # noqa: E731
    for wl, work in works.items():
        spec = work["spec"]
        print(f"  {wl}: response lengths (tokens, answer + spaces + EOS) sampled from the warm start: "
              f"{q(work['sampled'])}; target lognormal(median {spec['median']:g}, sigma {spec['sigma']:g}) + 2: "
              f"{q(work['target'])}; warm-start reward at temperature 1: {work['warm_reward']:.3f} (built in "
              f"{work['build_s']} s, cached in {os.path.dirname(work['model_dir'])})")
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()] or [None]

    configs: dict[str, list[tuple[str, str, int]]] = {}  # workload -> [(label, mode, threads)]
    for wl in workloads:
        cfgs = []
        for mode in modes:
            for t in (MODES[mode]["trainer_threads"] or sync_threads):
                label = f"{mode} t{t}" + (f"+engine{MODES[mode]['engine_threads']}"
                                          if MODES[mode]["engine_threads"] else "")
                cfgs.append((label, mode, t))
        configs[wl] = cfgs
    budget = lambda wl: {"max": args.max_response, "gen": args.gen_response,  # noqa: E731
                         "tiny": args.tiny_response}[WORKLOADS[wl]["response"]]
    results: dict[str, dict] = {wl: {label: {"runs": []} for label, _, _ in configs[wl]} for wl in workloads}
    trl_error = None
    if args.trl and importlib.util.find_spec("trl") is None:
        trl_error = "trl is not installed (pip install trl==1.12.0; check that torch keeps its version)"
        print(f"  TRL: {trl_error}")
    trl_threads = sync_threads if args.trl and trl_error is None else []
    rounds = [(rep, seed) for rep in range(args.repeats) for seed in seeds]
    for i, (rep, seed) in enumerate(rounds):  # round-robin: the machine's load drifts over every configuration alike
        for wl in workloads:
            for label, mode, t in configs[wl] + [(f"TRL t{t}", "TRL", t) for t in trl_threads]:
                if mode == "TRL":
                    r = run_trl(works[wl], budget(wl), args.batch, args.steps, args.reward_steps, t, KL_COEF)
                else:
                    r = run_one(works[wl], budget(wl), args.batch, mode, t, args.steps, args.reward_steps,
                                WORKLOADS[wl].get("overrides", []) + args.megappo_override + seed_overrides(seed))
                r["seed"] = seed
                results[wl].setdefault(label, {"runs": []})["runs"].append(r)
                status = r["error"].splitlines()[0] if "error" in r else \
                    (f"{r['samples_per_s']:.1f} samples/s, reward {r['reward']:.3f}"
                     + (f", generating {r['gen_share']:.0%} of the step" if mode == "sync" else ""))
                print(f"  [round {i + 1}/{len(rounds)}{'' if seed is None else f', seed {seed}'}] {wl:<9} "
                      f"{label:<24} {status} (load {os.getloadavg()[0]:.1f})", flush=True)

    best: dict[str, str | None] = {}
    targets = {}
    for wl in workloads:
        for label, res in results[wl].items():
            res["agg"] = aggregate(res["runs"])
        syncs = [lab for lab, m, _ in configs[wl] if m == "sync" and results[wl][lab]["agg"]["samples_per_s"]["n"]]
        best[wl] = max(syncs, key=lambda lab: results[wl][lab]["agg"]["samples_per_s"]["median"]) if syncs else None
        order = [lab for lab, _, _ in configs[wl]] + sorted(k for k in results[wl] if k.startswith("TRL"))
        print_workload_table(wl, results[wl], order, best[wl])
        trls = [k for k in results[wl] if k.startswith("TRL") and results[wl][k]["agg"]["samples_per_s"]["n"]]
        best_trl = max(trls, key=lambda k: results[wl][k]["agg"]["samples_per_s"]["median"]) if trls else None
        print_phases(results[wl], [best[wl]] + [lab for lab, m, _ in configs[wl] if m != "sync"] + [best_trl])
        targets[wl] = check_targets(wl, results[wl], configs[wl], best[wl])
        if len(seeds) > 1 and WORKLOADS[wl]["target"] == "speedup":
            targets[wl]["reward_gap"] = reward_gap(results[wl], configs[wl], best[wl])

    profile = None
    if args.profile and "one_step_off" in MODES:
        prof_path = os.path.join(tempfile.gettempdir(), f"megappo_bench_async_profile_{os.getpid()}.txt")
        r = run_one(works.get("balanced", first), args.max_response, args.batch, "one_step_off", 1, args.steps,
                    args.reward_steps,
                    args.megappo_override, profile_to=prof_path)
        if "error" in r or not os.path.exists(prof_path):
            print("\nprofile: " + r.get("error", "py-spy wrote nothing"))
        else:
            profile = {"run": r, "stacks": summarize_profile(prof_path), "raw": prof_path}
            print_profile(profile, args.steps)

    load1 = os.getloadavg()[0]
    print(f"\n1-min load average {load0:.1f} -> {load1:.1f} (other processes on the machine slow every run; "
          f"one_step_off needs both cores); total {time.perf_counter() - t_start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "workloads": works, "load": [load0, load1], "best_sync": best,
                       "targets": targets, "results": results, "profile": profile,
                       "trl_error": trl_error}, f, indent=1, default=str)
        print(f"wrote {args.json}")


def check_targets(wl: str, res: dict, cfgs: list, best_sync: str | None) -> dict:
    """The issue's targets for this workload, printed and returned."""
    out = {}
    if best_sync is None:
        return out
    b = res[best_sync]["agg"]
    sync1 = next((lab for lab, m, t in cfgs if m == "sync" and t == 1), None)
    for label, mode, _ in cfgs:
        if mode == "sync" or not res[label]["agg"]["samples_per_s"]["n"]:
            continue
        a = res[label]["agg"]
        r = spread(_round_ratios(res[label]["runs"], res[best_sync]["runs"]))
        ratio, lo, hi = r["median"], r["min"], r["max"]
        if WORKLOADS[wl]["target"] == "speedup":
            d_train = a["reward"]["median"] - b["reward"]["median"]
            n_train = math.hypot(a["reward_se"]["median"], b["reward_se"]["median"])
            d_val = n_val = None
            if a["val_reward"]["median"] is not None and b["val_reward"]["median"] is not None:
                d_val = a["val_reward"]["median"] - b["val_reward"]["median"]
                n_val = math.hypot(a["val_se"]["median"], b["val_se"]["median"])
            want = MODES[mode]["target"]
            ok_speed = ratio >= want
            ok_reward = abs(d_train) <= 0.05 and (d_val is None or abs(d_val) <= 0.05)
            val = ("" if d_val is None else
                   f"; final policy on {VAL_PROMPTS} held-out prompts {d_val:+.3f} (+-{n_val:.3f})")
            print(f"  target {label} >= {want}x best sync ({best_sync}): {ratio:.2f}x [{lo:.2f}-{hi:.2f}] -> "
                  f"{'MET' if ok_speed else 'MISSED'}")
            print(f"  target equal reward (within 0.05): training reward, last K steps {d_train:+.3f} (+-{n_train:.3f})"
                  f"{val} -> {'MET' if ok_reward else 'MISSED'}")
            # what bounds it: an overlapped step is at least max(engine generation, training on one thread)
            if sync1 and res[sync1]["agg"]["samples_per_s"]["n"]:
                s1 = res[sync1]["agg"]
                g, t1, t_async = s1["gen_s"]["median"], s1["train_s"]["median"], a["train_s"]["median"]
                ideal = b["step_s"]["median"] / max(g, t1)
                g_async = a["gen_s"]["median"]
                print(f"    bound: sync t1 generates {g:.3f} s and trains {t1:.3f} s a step, so overlapped perfectly "
                      f"{mode} would step in max({g:.3f}, {t1:.3f}) s: {ideal:.2f}x the best sync. Measured: "
                      f"it trains {t_async:.3f} s a step ({t_async / t1:.2f}x sync t1's) while its engine generates "
                      f"{g_async:.3f} s a batch ({g_async / g:.2f}x sync t1's) beside it, and waits "
                      f"{a['idle']['median']:.0%} of a step; the machine's other processes kept "
                      f"{a['cpu_others']['median']:.2f} of its {os.cpu_count()} cores busy during these runs")
            out[label] = {"speedup": ratio, "speedup_range": [lo, hi], "reward_diff": d_train,
                          "reward_noise": n_train, "val_reward_diff": d_val, "val_reward_noise": n_val,
                          "speedup_met": ok_speed, "reward_met": ok_reward}
        else:
            ok = ratio >= 0.95
            eq = ""
            if sync1 and sync1 != best_sync and res[sync1]["agg"]["samples_per_s"]["n"]:
                eq = (f"; vs sync t1 (the same trainer threads): "
                      f"{a['samples_per_s']['median'] / res[sync1]['agg']['samples_per_s']['median']:.2f}x")
            print(f"  target {label} overhead <= 5% (>= 0.95x best sync, {best_sync}): {ratio:.2f}x "
                  f"[{lo:.2f}-{hi:.2f}] -> {'MET' if ok else 'MISSED'}{eq}")
            out[label] = {"ratio": ratio, "ratio_range": [lo, hi], "met": ok}
    return out


def reward_gap(res: dict, cfgs: list, best_sync: str | None) -> dict:
    """Each asynchronous mode's reward minus the best sync's, paired by seed (a seed's repeats log the same rewards).
    Staleness lowers the reward on every seed: a mean gap beyond 2 standard errors. Noise gives gaps of both signs,
    of the size of the seed-to-seed spread of sync's own reward."""
    def by_seed(label: str, key: str) -> dict:
        return {r["seed"]: r[key] for r in res.get(label, {}).get("runs", [])
                if "error" not in r and r.get(key) is not None}

    out = {}
    if best_sync is None:
        return out
    for label, mode, _ in cfgs:
        if mode == "sync":
            continue
        for key, what in (("reward", "training reward, last K steps"), ("val_reward", "final policy, held out")):
            base, mine = by_seed(best_sync, key), by_seed(label, key)
            diffs = [mine[s] - base[s] for s in sorted(mine) if s in base]
            if len(diffs) < 2:
                continue
            mean, se = statistics.fmean(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs))
            sync_sd = statistics.stdev(base.values())
            verdict = "staleness" if abs(mean) > 2 * se else "noise"
            print(f"  reward gap {label} - {best_sync} ({what}) over {len(diffs)} seeds: "
                  + " ".join(f"{d:+.3f}" for d in diffs) + f"; mean {mean:+.3f} +- {se:.3f} (SE); sync's own "
                  f"seed-to-seed SD {sync_sd:.3f} -> {verdict}")
            out[f"{label} {key}"] = {"diffs": diffs, "mean": mean, "se": se, "sync_sd": sync_sd, "verdict": verdict}
    return out


def print_profile(profile: dict, steps: int) -> None:
    """Shares of each process's CPU samples (py-spy's absolute seconds drift with its sampling rate under load)."""
    r = profile["run"]
    print(f"\n== py-spy profile of one one_step_off balanced run ({r['samples_per_s']:.1f} samples/s under py-spy; "
          f"raw stacks in {profile['raw']}) ==")
    fixed = ("startup (imports)", "setup/teardown", "other")
    for role in ("trainer", "engine"):
        d = profile["stacks"].get(role)
        if not d:
            continue
        steady = {k: v for k, v in d["categories"].items() if k not in fixed}
        total = sum(steady.values()) or 1.0
        print(f"  {role}: {100 * total / d['busy_s']:.0f}% of its CPU samples in the {steps} steps (the rest: "
              f"imports, setup, teardown); of those: " + ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in
                                                                     steady.items()))
        skip = ("importlib", "import_utils", "dataclasses")
        top = [(k, v) for k, v in d["top"] if not any(x in k for x in skip)][:5]
        print("    hottest frames (share of all its samples): " + "; ".join(
            f"{k} {100 * v / d['busy_s']:.0f}%" for k, v in top))


if __name__ == "__main__":
    main()
