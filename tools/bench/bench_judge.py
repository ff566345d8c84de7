"""A generative judge's throughput on one in-process hf engine (megappo/rewards/judge/): judge prompts per second
at several batch sizes (reward_model.judge.batch_size), through `JudgeScorer` as the trainer calls it (templates,
tokenisation, engine calls, parsing), on this CPU.

Two judges (no download): the built-in digit_max_judge (megappo/tasks/digit_judge.py, made under --dir: ~40-80 s
the first time), 2 output tokens a verdict; and, with --random-model, a random-weight Qwen2 of the test factory
(hidden 256, 4 layers) made to write --new-tokens tokens a verdict (EOS ignored: a judge that reasons first).
Printed: threads, torch version, machine load, then per batch size the median of --repeats rounds of --items
samples: samples/s, seconds, engine calls.

    python tools/bench/bench_judge.py [--items 256] [--batch-sizes 8 32 64] [--random-model --new-tokens 32]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


class _LongVerdicts:
    """The engine with EOS ignored: every verdict --new-tokens long (the cost of a judge that reasons first)."""

    def __init__(self, engine):
        self.engine = engine

    def submit(self, prompts, params, **kw):
        from dataclasses import replace

        return self.engine.submit(prompts, replace(params, ignore_eos=True), **kw)

    def abort(self):
        self.engine.abort()


def _scorer(engine, tokenizer, batch: int, template: str, new_tokens: int, ignore_eos: bool):
    from megappo.rewards.judge import JudgeScorer, JudgeSettings, LoopSettings

    loop = LoopSettings(batch_size=batch, call_timeout_s=600.0, max_retries=0, max_new_tokens=new_tokens,
                        temperature=1.0, top_p=1.0, seed=0)
    settings = JudgeSettings(template=template, pairwise=False, use_chat_template=True, data_sources=(),
                             on_unparsed="zero", failure_score=0.0, log_rule_score=False, loop=loop,
                             max_failure_fraction=1.0, max_failure_steps=1)
    return JudgeScorer(_LongVerdicts(engine) if ignore_eos else engine, tokenizer, lambda verdict: 1.0, settings)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", type=int, default=256)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default="/tmp/megappo_bench_judge")
    p.add_argument("--random-model", action="store_true")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()

    import torch
    import transformers

    from megappo.rewards.judge.templates import template_text
    from megappo.rewards.scorer import ScoreItem
    from megappo.rollout.hf.engine import HFEngine
    from megappo.tasks.synthetic import TASKS

    torch.set_num_threads(args.threads)
    if args.random_model:
        from megappo.testing import make_hf_model

        path = os.path.join(args.dir, "random")
        if not os.path.exists(os.path.join(path, "config.json")):
            make_hf_model("qwen2", path, hidden_size=256, intermediate_size=512, num_hidden_layers=4)
        template, new_tokens, ignore_eos = template_text("default"), args.new_tokens, True
    else:
        from megappo.tasks.digit_judge import prepare_judge

        path = prepare_judge("digit_max_judge", os.path.join(args.dir, "digit_max_judge")).model_dir
        template, new_tokens, ignore_eos = template_text("digit_max"), 4, False
    task = TASKS["digit_max"]
    items = [ScoreItem(task.data_source, task.answer(c), task.answer(c), None, task.prompt(c), k)
             for k, c in enumerate(range(0, 10_000, 10_000 // args.items))][:args.items]
    engine = HFEngine(path, max_num_seqs=max(args.batch_sizes))
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    print(f"judge {'random qwen2 (hidden 256, 4 layers)' if args.random_model else 'digit_max_judge'}, "
          f"{new_tokens if ignore_eos else '<= ' + str(new_tokens)} tokens a verdict; threads {args.threads}; "
          f"torch {torch.__version__}; load {os.getloadavg()[0]:.1f}")
    for batch in args.batch_sizes:
        scorer = _scorer(engine, tokenizer, batch, template, new_tokens, ignore_eos)
        scorer.score(items[:batch])  # warm-up
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            result = scorer.score(items)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        print(f"batch {batch:4d}: {len(items) / med:8.1f} samples/s  ({med:.2f} s for {len(items)}, "
              f"{-(-len(items) // batch)} calls; unparsed {result.metrics()['reward/judge_unparsed_fraction']:.2f})")
    engine.close()


if __name__ == "__main__":
    main()
