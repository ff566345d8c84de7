"""A built-in multi-turn task: **tool_sum** (data_source `megappo/tool_sum`), the sum of three two-digit numbers,
which the tiny model cannot compute but can get from the calculator tool (megappo/multi_turn/calculator.py).

The prompt (user message) is `37+85+19=`; the right answer the sum (`141`, always three digits) then EOS. The way
to it is one tool call, copying the prompt's expression, and copying the tool's answer:

    <tool_call>{"name": "calculator", "arguments": {"expression": "37+85+19"}}</tool_call>
    (the template: <|im_end|>, a user turn <tool_response>\\n141\\n</tool_response>, the assistant's turn)
    141<|im_end|>

`prepare_task` writes (like `megappo.tasks.synthetic`, whose file layout and manifest it shares) a tiny Qwen2 with a
byte-level BPE tokenizer whose chat template renders tools and tool answers as Qwen2.5's does (`<|im_start|>`,
`<tool_call>`, `<tool_response>`; the JSON around the expression is two added tokens), and a supervised warm start
on an even mix of complete tool trajectories and direct answers with a random three-digit guess, where the first
answer token (call or guess) is weighted so that the model calls with probability `tool_fraction` (0.15). The warm
model copies well but seldom calls, so its reward starts near 0.15; RL has to learn that calling pays
(tool/calls_per_sample rises towards 1, the reward with it).

The reward (`tool_sum_reward`) is 1.0 when the last assistant message is exactly the sum, else 0.0.
This module imports neither torch nor pyarrow at import time (reward workers import it).
"""
from __future__ import annotations

import math
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from megappo.tasks import synthetic
from megappo.tasks.synthetic import TaskFiles, _one_thread

FORMAT_VERSION = 1
PAD, EOS, BOS_TURN = "<|endoftext|>", "<|im_end|>", "<|im_start|>"
CALL_OPEN = '{"name": "calculator", "arguments": {"expression": "'
CALL_CLOSE = '"}}'
ADDED = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "system", "user", "assistant",
         "calculator", CALL_OPEN, CALL_CLOSE)
# Qwen2.5's layout: tools in the system turn, tool answers grouped in a user turn, no newline inside the template text
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system{{ '\\n' }}{%- for t in tools %}{{ t.function.name }}{%- endfor %}"
    "<|im_end|>{{ '\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{%- endif %}"
    "{{ '\\n' }}<tool_response>{{ '\\n' }}{{ m.content }}{{ '\\n' }}</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>{{ '\\n' }}{%- endif %}"
    "{%- else %}<|im_start|>{{ m.role }}{{ '\\n' }}{{ m.content }}<|im_end|>{{ '\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{%- endif %}"
)
TOOL_SCHEMA = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses)",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


@dataclass(frozen=True)
class ToolTask:
    name: str = "tool_sum"
    data_source: str = "megappo/tool_sum"
    description: str = "the sum of three two-digit numbers ('37+85+19='), reachable only through the calculator tool"
    terms: int = 3
    tool_fraction: float = 0.15  # warm-start examples that call the tool (the others guess)
    warm_start_lr: float = 3e-3
    warm_start_batch: int = 64
    model: dict = field(default_factory=lambda: dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-6, hidden_act="silu",
        initializer_range=0.05, attention_dropout=0.0, tie_word_embeddings=False,
    ))

    def numbers(self, rng: random.Random) -> tuple[int, ...]:
        while True:  # three-digit sums only: every answer has the same length
            xs = tuple(rng.randint(10, 99) for _ in range(self.terms))
            if sum(xs) >= 100:
                return xs

    @staticmethod
    def expression(xs: tuple[int, ...]) -> str:
        return "+".join(map(str, xs))


TASKS: dict[str, ToolTask] = {"tool_sum": ToolTask()}


def tool_sum_reward(data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None) -> float:
    """1.0 when the final assistant message is exactly the answer (EOS aside), else 0.0."""
    messages = (extra_info or {}).get("messages") or []
    text = messages[-1]["content"] if messages and messages[-1].get("role") == "assistant" else solution_str
    return synthetic.exact_answer(text, ground_truth, (PAD, EOS))


def builtin_rewards() -> dict[str, Any]:
    return {t.data_source: tool_sum_reward for t in TASKS.values()}


def prepare_task(name: str, out_dir: str, *, num_train_prompts: int = 1024, num_val_prompts: int = 64,
                 warm_start_steps: int = 300, seed: int = 0) -> TaskFiles:
    """`megappo.tasks.synthetic.prepare_task` for the tool task (same files, manifest, locking and reuse)."""
    task = TASKS[name]
    params = synthetic.dataclass_params(name, task, FORMAT_VERSION, num_train_prompts, num_val_prompts,
                                        warm_start_steps, seed)
    return synthetic.prepared(name, task.data_source, out_dir, params, lambda d, p: _build(task, d, p))


def make_tokenizer(task: ToolTask, model_dir: str):
    """Write the tokenizer and model config; return (the tokenizer as loaded back, the config)."""
    loaded, config = write_chat_tokenizer(ADDED, task.model, model_dir)
    probe = render(loaded, (12, 34, 56), tool=True)
    if loaded.decode(loaded.encode(probe, add_special_tokens=False)) != probe or loaded.unk_token_id in \
            loaded.encode(probe, add_special_tokens=False):
        raise RuntimeError(f"the tool task's tokenizer does not round-trip its trajectories ({type(loaded).__name__})")
    return loaded, config


def write_chat_tokenizer(added: Sequence[str], model: dict, model_dir: str):
    """A byte-level Qwen2 tokenizer (every byte a token, `added` as whole tokens) with Qwen's chat template, and a
    Qwen2 config of `model`'s sizes for it, written to `model_dir`; returns (the tokenizer as loaded back, the
    config). The built-in multi-turn tasks' (this one's, megappo.tasks.guess_number's)."""
    import transformers

    vocab = {w: i for i, w in enumerate((PAD, EOS, BOS_TURN) + _byte_alphabet())}
    tok = transformers.Qwen2Tokenizer(vocab=vocab, merges=[], eos_token=EOS, pad_token=PAD, unk_token=PAD,
                                      bos_token=None, model_max_length=1 << 20)
    tok.add_special_tokens({"additional_special_tokens": [BOS_TURN]})
    tok.add_tokens(list(added))
    tok.chat_template = CHAT_TEMPLATE
    config = transformers.Qwen2Config(vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                                      pad_token_id=tok.pad_token_id, bos_token_id=None, **model)
    os.makedirs(model_dir, exist_ok=True)
    tok.save_pretrained(model_dir)
    config.save_pretrained(model_dir)
    return transformers.AutoTokenizer.from_pretrained(model_dir), config


def _byte_alphabet() -> tuple[str, ...]:
    """Byte-level BPE's 256 one-byte tokens (GPT-2's printable stand-ins), so any text a tool answers is spelled."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    extra = [b for b in range(256) if b not in keep]
    chars = [chr(b) for b in keep] + [chr(256 + k) for k in range(len(extra))]
    return tuple(chars)


def render(tokenizer, xs: tuple[int, ...], *, tool: bool, guess: Optional[int] = None) -> str:
    """A whole conversation's text: the prompt, then the tool trajectory or a direct answer."""
    expr, total = ToolTask.expression(xs), sum(xs)
    messages = [{"role": "user", "content": expr + "="}]
    if tool:
        messages += [{"role": "assistant", "content": f"<tool_call>{CALL_OPEN}{expr}{CALL_CLOSE}</tool_call>"},
                     {"role": "tool", "content": str(total)}, {"role": "assistant", "content": str(total)}]
    else:
        messages += [{"role": "assistant", "content": str(guess)}]
    return tokenizer.apply_chat_template(messages, tools=[TOOL_SCHEMA], tokenize=False)


def _examples(tokenizer, task: ToolTask, rng: random.Random, n: int, tool_share: float = 0.5):
    """(token ids, loss weights) of `n` warm-start conversations, `tool_share` of them tool trajectories. The weights
    are 1 on the assistant's tokens after the first; the first (the choice: call or guess) is weighted so that the
    model learns to call with probability `task.tool_fraction`, whatever `tool_share` is (so every example can teach
    the copying)."""
    import torch

    start_id, asst_id = tokenizer.convert_tokens_to_ids([BOS_TURN, "assistant"])
    rows, masks = [], []
    for _ in range(n):
        xs = task.numbers(rng)
        tool = rng.random() < tool_share
        text = render(tokenizer, xs, tool=tool, guess=rng.randint(100, 297))
        ids = tokenizer.encode(text, add_special_tokens=False)
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": task.expression(xs) + "="}],
                                               tools=[TOOL_SCHEMA], tokenize=False, add_generation_prompt=True)
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        mask = [0] * len(ids)
        # the assistant's tokens: from each "<|im_start|>assistant\n" to its <|im_end|> included
        k, inside = prompt_len, True
        while k < len(ids):
            if inside:
                mask[k] = 1
                inside = ids[k] != tokenizer.eos_token_id
                k += 1
            elif ids[k] == asst_id and ids[k - 1] == start_id:
                k, inside = k + 2, True  # the newline after "assistant" is the template's
            else:
                k += 1
        mask[prompt_len] = (task.tool_fraction / tool_share if tool else
                            (1 - task.tool_fraction) / (1 - tool_share) if tool_share < 1 else 0.0)
        rows.append(ids)
        masks.append(mask)
    width = max(map(len, rows))
    x = torch.full((n, width), tokenizer.pad_token_id)
    m = torch.zeros((n, width))
    for i, (ids, mask) in enumerate(zip(rows, masks)):
        x[i, :len(ids)] = torch.tensor(ids)
        m[i, :len(mask)] = torch.tensor(mask, dtype=torch.float32)
    return x, m


def _warm_start(task: ToolTask, tokenizer, config, steps: int, seed: int):
    import torch
    import transformers

    with _one_thread(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen2ForCausalLM(config).float()
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        rng = random.Random(seed * 1_000_003 + 31)
        if steps > 0:
            opt = torch.optim.AdamW(model.parameters(), lr=task.warm_start_lr, weight_decay=0.0)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
            model.train()
            for _ in range(steps):
                x, m = _examples(tokenizer, task, rng, task.warm_start_batch)
                logq = torch.log_softmax(model(input_ids=x).logits[:, :-1].float(), -1)
                nll = -logq.gather(-1, x[:, 1:, None])[..., 0]
                loss = (nll * m[:, 1:]).sum() / m[:, 1:].sum()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
        model.eval()
        with torch.no_grad():  # teacher-forced accuracy of the tool trajectories' tokens (copying)
            x, m = _examples(tokenizer, task, random.Random(seed + 7), 64, tool_share=1.0)
            pred = model(input_ids=x).logits[:, :-1].argmax(-1)
            right = ((pred == x[:, 1:]).float() * m[:, 1:]).sum() / m[:, 1:].sum()
        return model, {"steps": steps, "tool_token_accuracy": round(float(right), 4), "loss": round(float(loss), 4)
                       if steps > 0 else None}


def _build(task: ToolTask, out_dir: str, params: dict) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp = synthetic.fresh_tmp(out_dir)
    try:
        t0 = time.perf_counter()
        rng = random.Random(params["seed"] * 1_000_003 + 19)
        val = [task.numbers(rng) for _ in range(params["num_val_prompts"])]
        held = set(val)
        train = []
        while len(train) < params["num_train_prompts"]:
            xs = task.numbers(rng)
            if xs not in held:
                train.append(xs)
        for split, rows in (("train", train), ("val", val)):
            table = [{"data_source": task.data_source,
                      "prompt": [{"role": "user", "content": task.expression(xs) + "="}], "ability": "math",
                      "reward_model": {"style": "rule", "ground_truth": str(sum(xs))},
                      "extra_info": {"split": split, "index": i, "task": task.name}} for i, xs in enumerate(rows)]
            pq.write_table(pa.Table.from_pylist(table), os.path.join(tmp, f"{split}.parquet"))
        model_tmp = os.path.join(tmp, "model")
        tokenizer, config = make_tokenizer(task, model_tmp)
        model, metrics = _warm_start(task, tokenizer, config, params["warm_start_steps"], params["seed"])
        model.save_pretrained(model_tmp, safe_serialization=True)
        metrics["seconds"] = round(time.perf_counter() - t0, 2)
        manifest = {"params": params, "data_source": task.data_source, "description": task.description,
                    "warm_start": metrics}
        synthetic.swap_in(out_dir, tmp, manifest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest
