"""The built-in judge: a tiny model that says whether an answer to the digit_max task is right
(reward_model.judge.builtin=digit_max_judge; megappo/rewards/judge/).

It reads the digit_max prompt, the policy's answer and a question mark, as the `digit_max` judge template writes
them (`max 3 9 1 4 = 9 ?`), and answers `yes` or `no` and EOS. `prepare_judge` writes, deterministically in `seed`,

    <out_dir>/model/          a tiny Qwen2 causal LM and its byte-level BPE tokenizer (no chat template), whose
                              alphabet holds every character the digit_max policy can write
    <out_dir>/train.parquet   judge examples of the warm start's kind (prompt, verdict), for reading
    <out_dir>/val.parquet     held-out examples, on which the manifest's accuracies are measured
    <out_dir>/manifest.json   the parameters and those accuracies (written last)

reused when present with the same parameters (`megappo.tasks.synthetic.prepared`: locked, written atomically).

The answers it is trained on are the policy's kinds: the right digit (40%), another digit of the prompt (20%), any
other digit (15%, half of them above the right one) and garbage (25%: up to three of the policy's tokens, the empty
answer included, half of them around the right digit, as "99" or "9="); the verdict is the task's rule
(`exact_answer`). Prompts are drawn as the task draws them (every largest digit equally often).

The target is smoothed: the right verdict with weight 1 - `smoothing` (0.08), the other with `smoothing`, so a judge
that knew the rule would be right on every answer greedily and on 92% sampled at temperature 1 (the tiny_judge_ppo
recipe samples it). Measured (manifest, held-out answers): greedy 94% right, sampled 87%; it errs towards "no" on
right answers more than towards "yes" on wrong ones, so the policy finds no wrong answer it is paid for, and the
judge's reward and the true accuracy differ visibly. About 40 s on 2 cores (75 s under the golden environment's
scalar kernels).
"""
from __future__ import annotations

import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass

from megappo.tasks.synthetic import (
    DIGITS, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, TASKS, TaskFiles, exact_answer, fresh_tmp, prepared, swap_in,
)

FORMAT_VERSION = 1
VERDICTS = ("yes", "no")
# what the digit_max policy's tokens decode to (besides the digits): garbage answers are made of these
POLICY_PIECES = (" ", "=", " =", "max", "m", "a", "x")


@dataclass(frozen=True)
class DigitJudge:
    """The judge's model and warm start (everything that decides its files)."""

    name: str = "digit_max_judge"
    task: str = "digit_max"  # the policy task it judges
    template: str = "{question} {response} ?"  # megappo/rewards/judge/templates.py's digit_max
    hidden_size: int = 128  # twice the policy's: at 64 the rule on small digits is still half learned
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    steps: int = 600
    batch: int = 64
    lr: float = 1e-3  # at 3e-3 the warm start can settle on comparing digits without checking the answer is one
    smoothing: float = 0.08
    right_fraction: float = 0.40
    garbage_fraction: float = 0.25
    near_fraction: float = 0.20  # wrong answers that are another digit of the prompt (the rest: any other digit)
    above_fraction: float = 0.5  # of the other digits, those above the answer

    def example(self, rng: random.Random, code: int) -> tuple[str, str]:
        """(the judge's prompt, the right verdict) for a drawn answer to digit_max prompt `code`."""
        task = TASKS[self.task]
        answer, u = task.answer(code), rng.random()
        if u < self.right_fraction:
            response = answer
        elif u < self.right_fraction + self.garbage_fraction:
            junk = "".join(rng.choice(DIGITS + POLICY_PIECES) for _ in range(rng.randrange(4)))
            # half of it around the right digit ("99", "9=", "19"): a judge fooled by those is hacked at once
            response = junk if rng.random() < 0.5 else rng.choice([answer + junk, junk + answer])
        elif u < self.right_fraction + self.garbage_fraction + self.near_fraction:
            # a digit of the prompt that is not its largest: the policy's own mistakes are mostly these
            others = sorted({str(d) for d in task.digits(code)} - {answer})
            response = rng.choice(others or [d for d in DIGITS if d != answer])
        else:
            # a digit not in the prompt; often one above its largest, which a judge that only compares digits
            # (and not whether the answer is one of them) would accept, and which the policy learns to exploit
            above = [d for d in DIGITS if d > answer]
            response = rng.choice(above if above and rng.random() < self.above_fraction else
                                  [d for d in DIGITS if d != answer])
        text = self.template.format(question=task.prompt(code), response=response.strip())
        return text, "yes" if exact_answer(response, answer, SPECIAL_TOKENS) else "no"


JUDGES = {"digit_max_judge": DigitJudge()}


def prepare_judge(name: str, out_dir: str, *, seed: int = 0) -> TaskFiles:
    """Write built-in judge `name` under `out_dir` (reused when there with the same parameters); its files."""
    if name not in JUDGES:
        raise ValueError(f"unknown built-in judge {name!r}; set reward_model.judge.builtin to one of "
                         f"{', '.join(sorted(JUDGES))} or null")
    judge = JUDGES[name]
    params = {"format": FORMAT_VERSION, "judge": name, "seed": seed, "spec": asdict(judge)}
    return prepared(name, TASKS[judge.task].data_source, out_dir, params, lambda d, p: _build(judge, d, p),
                    steps=judge.steps)


def _codes(judge: DigitJudge, seed: int) -> tuple[dict[int, list[int]], list[int]]:
    """The judged task's training prompt pools (answer -> codes) and distinct held-out validation codes, drawn as
    the task draws its prompts: every answer equally often (uniform codes would almost never show the judge a
    prompt whose largest digit is small, and the policy's answers to those would fool it)."""
    task = TASKS[judge.task]
    pools = task.pools()
    val = task.sample(random.Random(seed * 1_000_003 + 41), 512, pools, distinct=True)
    held_out = set(val)
    return {a: [c for c in p if c not in held_out] for a, p in pools.items()}, val


def _build(judge: DigitJudge, out_dir: str, params: dict) -> dict:
    tmp = fresh_tmp(out_dir)
    try:
        t0 = time.perf_counter()
        train_pools, val_codes = _codes(judge, params["seed"])
        rng = random.Random(params["seed"] * 1_000_003 + 43)
        val = [judge.example(rng, c) for c in val_codes]
        _write_examples(os.path.join(tmp, "val.parquet"), val)
        train = TASKS[judge.task].sample(rng, 1024, train_pools, distinct=False)
        _write_examples(os.path.join(tmp, "train.parquet"), [judge.example(rng, c) for c in train])
        model_dir = os.path.join(tmp, "model")
        tokenizer, config = _write_tokenizer_and_config(judge, model_dir)
        model, metrics = _warm_start(judge, tokenizer, config, params["seed"], train_pools, val)
        model.save_pretrained(model_dir, safe_serialization=True)
        metrics["seconds"] = round(time.perf_counter() - t0, 2)
        manifest = {"params": params, "judge": judge.name, "warm_start": metrics}
        swap_in(out_dir, tmp, manifest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def _write_examples(path: str, examples: list[tuple[str, str]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": [p for p, _ in examples], "verdict": [v for _, v in examples]}), path)


def _write_tokenizer_and_config(judge: DigitJudge, model_dir: str):
    """A Qwen2 byte-level BPE over the judge's alphabet (digits, the policy's pieces, "?", the verdicts)."""
    import transformers

    tokens = list(DIGITS) + ["Ġ", "=", "Ġ=", "?", "Ġ?"]
    merges = [("Ġ", "="), ("Ġ", "?")]
    for word in ("max", *VERDICTS):
        for ch in word:
            if ch not in tokens:
                tokens.append(ch)
        for i in range(2, len(word) + 1):
            merges.append((word[:i - 1], word[i - 1]))
            tokens.append(word[:i])
    vocab = {w: i for i, w in enumerate(SPECIAL_TOKENS + tuple(dict.fromkeys(tokens)))}
    tokenizer = transformers.Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
                                            unk_token=PAD_TOKEN, bos_token=None, model_max_length=128)
    config = transformers.Qwen2Config(
        vocab_size=len(vocab), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None, hidden_size=judge.hidden_size, intermediate_size=judge.intermediate_size,
        num_hidden_layers=judge.num_hidden_layers, num_attention_heads=judge.num_attention_heads,
        num_key_value_heads=judge.num_key_value_heads, max_position_embeddings=128, rope_theta=10000.0,
        rms_norm_eps=1e-6, hidden_act="silu", initializer_range=0.05, tie_word_embeddings=False)
    os.makedirs(model_dir, exist_ok=True)
    tokenizer.save_pretrained(model_dir)
    config.save_pretrained(model_dir)
    loaded = transformers.AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)  # our own files
    for word in VERDICTS:
        if len(loaded(word)["input_ids"]) != 1:
            raise RuntimeError(f"the judge's tokenizer splits the verdict {word!r} (transformers "
                               f"{transformers.__version__})")
    return loaded, config


def _batch(tokenizer, examples: list[tuple[str, str]]):
    """Right-padded [B, L] ids of prompt + verdict + EOS, and each prompt's length."""
    import torch

    ids = [tokenizer(p)["input_ids"] for p, _ in examples]
    verdict = tokenizer.convert_tokens_to_ids([v for _, v in examples])
    width = max(len(i) for i in ids) + 2
    x = torch.full((len(ids), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(x)
    for r, (i, v) in enumerate(zip(ids, verdict)):
        row = i + [v, tokenizer.eos_token_id]
        x[r, :len(row)], mask[r, :len(row)] = torch.tensor(row), 1
    return x, mask, torch.tensor([len(i) for i in ids])


def _verdict_logprobs(model, tokenizer, examples):
    """log q over the vocabulary at the verdict and at the token after it [B, 2, V], and the batch."""
    import torch

    x, mask, lengths = _batch(tokenizer, examples)
    logits = model(input_ids=x, attention_mask=mask).logits.float()
    rows = torch.arange(len(examples))
    at = torch.stack([logits[rows, lengths - 1], logits[rows, lengths]], 1)
    return torch.log_softmax(at, -1), x, lengths


def _warm_start(judge: DigitJudge, tokenizer, cfg, seed: int, train_pools: dict[int, list[int]], val):
    import torch
    import transformers

    from megappo.tasks.synthetic import _one_thread

    yes_no = torch.tensor(tokenizer.convert_tokens_to_ids(list(VERDICTS)))
    eos = tokenizer.eos_token_id
    with _one_thread(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen2ForCausalLM(cfg).float()
        model.generation_config.eos_token_id, model.generation_config.pad_token_id = eos, tokenizer.pad_token_id
        opt = torch.optim.AdamW(model.parameters(), lr=judge.lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / judge.steps)))
        rng = random.Random(seed * 1_000_003 + 47)
        model.train()
        for _ in range(judge.steps):
            codes = TASKS[judge.task].sample(rng, judge.batch, train_pools, distinct=False)
            examples = [judge.example(rng, c) for c in codes]
            logq, x, lengths = _verdict_logprobs(model, tokenizer, examples)
            right = torch.tensor([0 if v == "yes" else 1 for _, v in examples])
            pair = logq[:, 0, yes_no]  # [B, 2]: log q(yes), log q(no)
            target = torch.full_like(pair, judge.smoothing).scatter(1, right[:, None], 1 - judge.smoothing)
            loss = (-(target * pair).sum(-1) - logq[:, 1, eos]).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        model.eval()
        with torch.no_grad():
            logq, _, _ = _verdict_logprobs(model, tokenizer, val)
            right = torch.tensor([0 if v == "yes" else 1 for _, v in val])
            q = logq[:, 0].exp()
            metrics = {"steps": judge.steps,
                       # the chance that a temperature-1 verdict is the right one (and then ends)
                       "val_right_verdict_t1": round(float((q[:, yes_no].gather(1, right[:, None])[:, 0]
                                                            * logq[:, 1, eos].exp()).mean()), 4),
                       "val_greedy_accuracy": round(float((q.argmax(-1) == yes_no[right]).float().mean()), 4)}
    return model, metrics
