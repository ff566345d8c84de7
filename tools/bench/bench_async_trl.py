"""The TRL side of tools/bench/bench_async.py (TRL 1.12's PPO trainer on the same workload, timed with
tools/bench/bench_ppo_iteration.py's instrumentation) and the CPU accounting both sides use."""
from __future__ import annotations

import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import types


def cpu_snapshot(self_too: bool = False) -> tuple:
    """(wall, the machine's busy CPU seconds, this process's children's (and own) CPU seconds)."""
    import resource

    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    busy = (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait (guest is in user)
    ours = sum(getattr(resource.getrusage(who), k) for k in ("ru_utime", "ru_stime")
               for who in ((resource.RUSAGE_CHILDREN, resource.RUSAGE_SELF) if self_too else
                           (resource.RUSAGE_CHILDREN,)))
    return time.perf_counter(), busy, ours, self_too


def cpu_used(before: tuple) -> dict:
    """Cores busy on average since `before`: ours (the run, its children included) and the machine's other
    processes'."""
    wall0, busy0, ours0, self_too = before
    wall1, busy1, ours1, _ = cpu_snapshot(self_too)
    wall = wall1 - wall0
    ours = (ours1 - ours0) / wall
    return {"wall": wall, "ours": ours, "others": max(0.0, (busy1 - busy0) / wall - ours)}



# ------------------------------------------------------------------------------------------------------------
# TRL 1.12's PPO on the same workload
# ------------------------------------------------------------------------------------------------------------
def _rule_reward_model(tok, context_length: int):
    """digit_max's rule reward as the reward "model" TRL's get_reward calls: `backbone(input_ids=...)` returns the
    score of each row at every position (`score` is the identity), so get_reward reads it at the last token."""
    import torch
    from megappo.tasks import get_task, synthetic_reward

    task = get_task("digit_max")
    digit_ids = {tok.convert_tokens_to_ids(str(d)): d for d in range(10)}

    class Backbone(torch.nn.Module):
        def forward(self, input_ids, attention_mask, **kw):
            scores = []
            for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
                prompt = [digit_ids[t] for t in ids[:context_length] if t in digit_ids]
                response = [t for t, m in zip(ids[context_length:], mask[context_length:]) if m]
                scores.append(synthetic_reward(task.data_source, tok.decode(response), str(task.answer_fn(prompt))))
            out = torch.tensor(scores)[:, None, None].expand(input_ids.shape[0], input_ids.shape[1], 1)
            return types.SimpleNamespace(hidden_states=[out])

    class RuleReward(torch.nn.Module):
        base_model_prefix = "backbone"

        def __init__(self):
            super().__init__()
            self.backbone = Backbone()

        def score(self, hidden):
            return hidden

    return RuleReward()


def run_trl(work: dict, max_response: int, batch: int, steps: int, reward_steps: int, threads: int,
            kl_coef: float) -> dict:
    """TRL's PPOTrainer.train() for `steps` iterations, its console output held back; the same summary as a megappo
    run (first step dropped), or {"error": ...}."""
    import contextlib
    import io
    import warnings

    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    held = io.StringIO()
    try:
        with contextlib.redirect_stdout(held), contextlib.redirect_stderr(held), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _run_trl(work, max_response, batch, steps, reward_steps, threads, kl_coef)
    except Exception as e:  # noqa: BLE001 - reported in the table
        tail = "\n".join(held.getvalue().strip().splitlines()[-15:])
        return {"error": f"TRL failed: {type(e).__name__}: {e}\n{tail}"}


def _run_trl(work: dict, max_response: int, batch: int, steps: int, reward_steps: int, threads: int,
             kl_coef: float) -> dict:
    import torch
    import trl.experimental.ppo.ppo_trainer as ppo_mod
    from datasets import Dataset
    from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                              PrinterCallback)
    from trl.experimental.ppo import PPOConfig

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_ppo_iteration import TRL_PHASES, _timed, _trl_step_recorder
    import pyarrow.parquet as pq

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    out_dir = tempfile.mkdtemp(prefix="megappo_bench_async_trl_")
    try:
        tok = AutoTokenizer.from_pretrained(work["model_dir"], padding_side="left")
        texts = [r[0]["content"] for r in pq.read_table(work["train_files"]).column("prompt").to_pylist()]
        ids = [tok(t)["input_ids"] for t in texts[:batch * steps]]
        context = len(ids[0])
        if any(len(i) != context for i in ids):
            return {"error": "prompts of different token lengths"}
        args = PPOConfig(
            output_dir=out_dir, use_cpu=True, bf16=False, fp16=False, per_device_train_batch_size=batch,
            gradient_accumulation_steps=1, num_mini_batches=2, num_ppo_epochs=1, total_episodes=batch * steps,
            response_length=max_response, local_rollout_forward_batch_size=batch, stop_token="eos",
            temperature=1.0, num_sample_generations=0, learning_rate=1e-3, kl_coef=kl_coef, report_to=[],
            save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0, seed=0)
        trainer = ppo_mod.PPOTrainer(
            args=args, processing_class=tok,
            model=AutoModelForCausalLM.from_pretrained(work["model_dir"], dtype=torch.float32),
            ref_model=AutoModelForCausalLM.from_pretrained(work["model_dir"], dtype=torch.float32),
            reward_model=_rule_reward_model(tok, context),
            value_model=AutoModelForSequenceClassification.from_pretrained(work["model_dir"], num_labels=1,
                                                                           dtype=torch.float32),
            train_dataset=Dataset.from_dict({"input_ids": ids}), eval_dataset=Dataset.from_dict({"input_ids": ids}))
        trainer.remove_callback(PrinterCallback)
        timers, records = {}, []
        trainer.add_callback(_trl_step_recorder(timers, records))
        originals = {n: getattr(ppo_mod, n) for n in ("batch_generation", "forward", "get_reward")}
        lengths: list[float] = []  # mean response tokens (EOS included) of each generated batch

        def generation(*a, **kw):
            query_responses, logits = originals["batch_generation"](*a, **kw)
            response = query_responses[:, context:]
            ended = (response == tok.eos_token_id).int().cumsum(-1)  # EOS and everything after it: 1 or more
            lengths.append(float(((ended == 0) | ((ended == 1) & (response == tok.eos_token_id))).sum(-1)
                                 .float().mean()))
            return query_responses, logits

        ppo_mod.batch_generation = _timed(generation, timers, lambda a: "rollout")
        ppo_mod.forward = _timed(originals["forward"], timers, lambda a: "ref" if a[0] is trainer.ref_model else None)
        ppo_mod.get_reward = _timed(originals["get_reward"], timers,
                                    lambda a: "reward_model" if a[0] is trainer.reward_model else "values")
        import gc

        ppo_mod.gc = types.SimpleNamespace(collect=_timed(gc.collect, timers, lambda a: "gc.collect"))
        cpu0 = cpu_snapshot(self_too=True)
        try:
            trainer.train()
        finally:
            for name, fn in originals.items():
                setattr(ppo_mod, name, fn)
            ppo_mod.gc = gc
        cpu = cpu_used(cpu0)
        wall = cpu["wall"]
        logs = [h for h in trainer.state.log_history if "objective/scores" in h]
        rewards = [h["objective/scores"] for h in logs]
        steady = records[1:]
        if not steady:
            return {"error": f"TRL ran {len(records)} step(s); need at least 2"}
        step_s = sum(r["step"] for r in steady)
        gen_s = sum(r.get("rollout", 0.0) for r in steady)
        last = rewards[-reward_steps:]
        reward = statistics.fmean(last) if last else float("nan")
        phases = {k: sum(r.get(k, 0.0) for r in steady) / len(steady) for k in TRL_PHASES[:-1]}
        phases["update"] = step_s / len(steady) - sum(phases.values())
        phases["step"] = step_s / len(steady)
        return {
            "samples_per_s": batch * len(steady) / step_s, "step_s": step_s / len(steady), "idle": gen_s / step_s,
            "gen_s": gen_s / len(steady), "train_s": (step_s - gen_s) / len(steady), "reward": reward,
            "reward_se": math.sqrt(max(reward * (1 - reward), 1e-12) / (batch * max(len(last), 1))),
            "val_reward": None, "val_se": None, "cpu_ours": cpu["ours"], "cpu_others": cpu["others"],
            "length_mean": statistics.fmean(lengths[1:]) if len(lengths) > 1 else float("nan"),
            "phases": phases, "wall": wall,
            "per_step": {"reward": [round(x, 4) for x in rewards], "step_s": [round(r["step"], 4) for r in records],
                         "rollout_s": [round(r.get("rollout", 0.0), 4) for r in records],
                         "length": [round(x, 4) for x in lengths]},
        }
    finally:
        torch.set_num_threads(before)
        shutil.rmtree(out_dir, ignore_errors=True)
