"""A built-in multi-step environment task: **guess_number** (data_source `megappo/guess_number`, agent_name
`guess_number`), which cannot be solved without the environment's feedback.

A secret integer in `low..high` (1..15); the model's whole message is a guess; the environment (`GuessNumberEnv`,
megappo/envs/guess_number.py) answers `higher` or `lower` as a user message, or ends the episode: reward 1.0 when
the guess is right, 0.0 after `max_turns` (4) wrong guesses. Fifteen numbers in four guesses is exactly what binary
search covers (2^4 - 1), so a policy that follows the hints (8, then 4 or 12, ...) always wins, and one that ignores
them wins ~0.25 of episodes (four uniform guesses). Per-row arguments live in `extra_info` (`low`, `high`,
`max_turns`), so a dataset can vary them; the prompt states the range: `guess 1-15`.

The token layout is the episode loop's: the prompt is the chat template of the prompt messages with the generation
prompt; each assistant turn is the sampled number and <|im_end|>; each hint is the template's delta

    \\n<|im_start|>user\\nhigher<|im_end|>\\n<|im_start|>assistant\\n

so a whole episode's tokens equal the tokenisation of `apply_chat_template` over its messages (`episode_ids` builds
them from pieces; the tests compare both). The numbers 10..high, the role names and the hint words are added tokens:
a guess is one token and EOS, a hint turn ten tokens, a four-turn episode under 60.

`prepare_task` writes (like `megappo.tasks.synthetic`, whose file layout, manifest and locking it shares) a tiny
Qwen2 with tool_sum's byte-level tokenizer and Qwen-style chat template, and Parquet rows in verl's schema with an
`agent_name` column. Every row has the same prompt (the range), so train and val differ only in their secrets,
balanced over the range. The warm start (500 steps, ~40 s on one thread) is supervised on episodes played by a mix
of the hint-following guess (the middle of the range the hints leave; 80% of guesses) and a uniform guess; each
guess token's target is smoothed: the middle with weight 1 - `smoothing` (0.75), each number of the range with
`smoothing` / size. The warm model ranks the middle first (greedy play wins every episode) but samples it with
probability ~0.3, so at temperature 1 it wins ~0.3 of episodes and RL has to make it follow the hints it already
reads (as digit_max's smoothed warm start, `megappo.tasks.synthetic`). Measured outside the trainer: REINFORCE
(64 episodes a step, Adam 1e-3) takes the win rate from ~0.3 to ~0.57 in 50 steps and ~0.88 in 100.

The reward (`guess_number_reward`) is the episode's summed environment reward, which the trainer puts in
`extra_info["env_reward"]`. This module imports neither torch nor pyarrow at import time (reward workers import it).
"""
from __future__ import annotations

import math
import os
import random
import re
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from megappo.tasks import synthetic
from megappo.tasks.synthetic import TaskFiles, _one_thread
from megappo.tasks.tool_sum import write_chat_tokenizer

FORMAT_VERSION = 1
PAD, EOS, BOS_TURN = "<|endoftext|>", "<|im_end|>", "<|im_start|>"
HIGHER, LOWER, NOT_A_NUMBER = "higher", "lower", "not a number"
AGENT_NAME = "guess_number"
_NUMBER = re.compile(r"[0-9]{1,9}")  # ASCII digits only (int() takes other scripts' digits and underscores)


@dataclass(frozen=True)
class GuessTask:
    name: str = "guess_number"
    data_source: str = "megappo/guess_number"
    description: str = "guess a secret number in 1..15 in four guesses, told 'higher' or 'lower' after each"
    low: int = 1
    high: int = 15
    max_turns: int = 4
    smoothing: float = 0.75  # each guess token's target: 1 - smoothing on the middle, smoothing spread over the range
    # warm-start episodes are played by the middle guess this often (else uniform): mostly binary search, so that the
    # deep states RL will reach (three hints read) are well learnt, with enough stray guesses to cover the initial
    # policy's histories
    history_mid_share: float = 0.8
    warm_start_lr: float = 3e-3
    warm_start_batch: int = 64
    model: dict = field(default_factory=lambda: dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-6, hidden_act="silu",
        initializer_range=0.05, attention_dropout=0.0, tie_word_embeddings=False,
    ))

    def prompt(self, low: Optional[int] = None, high: Optional[int] = None) -> list[dict]:
        return [{"role": "user", "content": f"guess {self.low if low is None else low}-"
                                            f"{self.high if high is None else high}"}]

    def added_tokens(self) -> tuple[str, ...]:
        numbers = tuple(str(n) for n in range(10, self.high + 1))
        return ("system", "user", "assistant", "guess", HIGHER, LOWER) + numbers


TASKS: dict[str, GuessTask] = {"guess_number": GuessTask()}


# ---------------------------------------------------------------------------------------------------------------
# the game's rules (its environment: megappo/envs/guess_number.py)
# ---------------------------------------------------------------------------------------------------------------
def parse_guess(text: Any) -> Optional[int]:
    """The integer a message is (surrounding whitespace and EOS/pad tokens aside), or None when it is anything else:
    words, signs, several numbers, more than nine digits, non-ASCII digits, a non-string."""
    if not isinstance(text, str):
        return None
    for token in (EOS, PAD):
        text = text.replace(token, " ")
    text = text.strip()
    return int(text) if _NUMBER.fullmatch(text) else None


def guess_number_reward(data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None
                        ) -> float:
    """The episode's summed environment reward (`extra_info["env_reward"]`), 0.0 when absent or not a number."""
    value = (extra_info or {}).get("env_reward")
    try:
        value = float(value)
    except (TypeError, ValueError):
        return 0.0
    return value if math.isfinite(value) else 0.0


def builtin_rewards() -> dict[str, Any]:
    return {t.data_source: guess_number_reward for t in TASKS.values()}


# ---------------------------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------------------------
def prepare_task(name: str, out_dir: str, *, num_train_prompts: int = 1024, num_val_prompts: int = 64,
                 warm_start_steps: int = 500, seed: int = 0) -> TaskFiles:
    """`megappo.tasks.synthetic.prepare_task` for the guessing task (same files, manifest, locking and reuse)."""
    task = TASKS[name]
    params = synthetic.dataclass_params(name, task, FORMAT_VERSION, num_train_prompts, num_val_prompts,
                                        warm_start_steps, seed)
    return synthetic.prepared(name, task.data_source, out_dir, params, lambda d, p: _build(task, d, p))


def rows(task: GuessTask, secrets: Sequence[int], split: str) -> list[dict]:
    """Dataset rows in verl's schema, plus the `agent_name` column that picks the environment."""
    return [{"data_source": task.data_source, "prompt": task.prompt(), "ability": "logic",
             "reward_model": {"style": "rule", "ground_truth": str(s)},
             "extra_info": {"split": split, "index": i, "task": task.name, "low": task.low, "high": task.high,
                            "max_turns": task.max_turns},
             "agent_name": AGENT_NAME} for i, s in enumerate(secrets)]


def balanced_secrets(task: GuessTask, n: int, rng: random.Random) -> list[int]:
    """`n` secrets, each number of the range within one of the others' counts, shuffled."""
    span = list(range(task.low, task.high + 1))
    out = [span[i % len(span)] for i in range(n)]
    rng.shuffle(out)
    return out


def make_tokenizer(task: GuessTask, model_dir: str):
    """Write the tokenizer and model config; return (the tokenizer as loaded back, the config)."""
    loaded, config = write_chat_tokenizer(task.added_tokens(), task.model, model_dir)
    probe = [(task.low, HIGHER), (task.high, LOWER), (task.high - 1, None)]
    messages = task.prompt() + conversation(probe)
    text = loaded.apply_chat_template(messages, tokenize=False)
    ids = loaded.encode(text, add_special_tokens=False)
    # the template closes the last assistant turn with a newline the episode's tokens end before
    laid_out = episode_ids(loaded, task.prompt(), probe)
    if loaded.decode(ids) != text or loaded.unk_token_id in ids or ids[:-1] != laid_out:
        raise RuntimeError(f"the guessing task's tokenizer does not round-trip its episodes ({type(loaded).__name__})")
    return loaded, config


def conversation(turns: Sequence[tuple[int, Optional[str]]]) -> list[dict]:
    """The messages after the prompt of an episode's turns: (guess, the environment's answer or None at the end)."""
    out: list[dict] = []
    for guess, hint in turns:
        out.append({"role": "assistant", "content": str(guess)})
        if hint is not None:
            out.append({"role": "user", "content": hint})
    return out


def episode_ids(tokenizer, prompt: list[dict], turns: Sequence[tuple[int, Optional[str]]]) -> list[int]:
    """An episode's token ids as the episode loop lays them out: the prompt with the generation prompt, each guess's
    tokens and EOS, each answer's delta (the template's text around it, the answer tokenised alone)."""
    return _Pieces(tokenizer, prompt).episode(turns)[0]


class _Pieces:
    """An episode's token pieces for one tokenizer and prompt, tokenised once (the warm start lays out thousands)."""

    def __init__(self, tokenizer, prompt: list[dict]):
        self.tokenizer = tokenizer
        self.prompt = self.enc(tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True))
        self.head, self.tail = self.enc(f"\n{BOS_TURN}user\n"), self.enc(f"{EOS}\n{BOS_TURN}assistant\n")
        self.deltas: dict[str, list[int]] = {}

    def enc(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def delta(self, hint: str) -> list[int]:
        if hint not in self.deltas:  # the answer alone, special-token matching off (as untrusted text is)
            self.deltas[hint] = self.head + self.tokenizer.encode(hint, add_special_tokens=False,
                                                                  split_special_tokens=True) + self.tail
        return self.deltas[hint]

    def episode(self, turns: Sequence[tuple[int, Optional[str]]]) -> tuple[list[int], list[int]]:
        """(token ids, the position of each guess's first token)."""
        ids, starts = list(self.prompt), []
        for guess, hint in turns:
            starts.append(len(ids))
            ids += self.enc(str(guess)) + [self.tokenizer.eos_token_id]
            if hint is not None:
                ids += self.delta(hint)
        return ids, starts


def play_mixture(task: GuessTask, secret: int, rng: random.Random, mid_share: float
                 ) -> list[tuple[int, Optional[str], int, int]]:
    """One episode of the warm start's behaviour policy: (guess, answer, and the range the hints left before the
    guess: lo, hi) per turn. The guess is the middle of that range with probability `mid_share`, else uniform over
    the whole range (ignoring the hints)."""
    lo, hi, out = task.low, task.high, []
    for turn in range(task.max_turns):
        guess = (lo + hi) // 2 if rng.random() < mid_share else rng.randint(task.low, task.high)
        before = (lo, hi)
        if guess == secret or turn == task.max_turns - 1:
            out.append((guess, None, *before))
            break
        hint = HIGHER if guess < secret else LOWER
        lo, hi = (max(lo, guess + 1), hi) if hint == HIGHER else (lo, min(hi, guess - 1))
        out.append((guess, hint, *before))
    return out


def _examples(pieces: _Pieces, task: GuessTask, rng: random.Random, n: int, mid_share: float):
    """`n` warm-start episodes: token ids [n, T] (padded), and the supervised positions: guesses [G, 3] (row, the
    guess token's position, the middle's token id) and EOS tokens [E, 2] (row, position)."""
    import torch

    tok = pieces.tokenizer
    guesses, eos, seqs = [], [], []
    for r in range(n):
        episode = play_mixture(task, rng.randint(task.low, task.high), rng, mid_share)
        ids, starts = pieces.episode([(g, h) for g, h, _, _ in episode])
        for k, (_, _, lo, hi) in zip(starts, episode):
            guesses.append((r, k, tok.convert_tokens_to_ids(str((lo + hi) // 2))))
            eos.append((r, k + 1))
        seqs.append(ids)
    x = torch.full((n, max(map(len, seqs))), tok.pad_token_id)
    for r, ids in enumerate(seqs):
        x[r, :len(ids)] = torch.tensor(ids)
    return x, torch.tensor(guesses), torch.tensor(eos)


def _loss(model, task: GuessTask, batch, range_ids, eos_id: int):
    """Smoothed cross-entropy of the guess tokens and cross-entropy of their EOS, averaged over both."""
    import torch

    x, guesses, eos = batch
    hidden = model.model(input_ids=x).last_hidden_state  # [n, T, H]; the vocabulary only where supervised
    at_guess = torch.log_softmax(model.lm_head(hidden[guesses[:, 0], guesses[:, 1] - 1]).float(), -1)  # [G, V]
    at_eos = torch.log_softmax(model.lm_head(hidden[eos[:, 0], eos[:, 1] - 1]).float(), -1)  # [E, V]
    guess_nll = -(1 - task.smoothing) * at_guess.gather(-1, guesses[:, 2:3])[:, 0] \
        - task.smoothing * at_guess[:, range_ids].mean(-1)
    eos_nll = -at_eos[:, eos_id]
    return (guess_nll.sum() + eos_nll.sum()) / (len(guess_nll) + len(eos_nll)), at_guess


def _warm_start(task: GuessTask, tokenizer, config, steps: int, seed: int):
    import torch
    import transformers

    pieces = _Pieces(tokenizer, task.prompt())
    range_ids = torch.tensor(tokenizer.convert_tokens_to_ids([str(n) for n in range(task.low, task.high + 1)]))
    with _one_thread(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen2ForCausalLM(config).float()
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        rng = random.Random(seed * 1_000_003 + 37)
        loss = None
        if steps > 0:
            opt = torch.optim.AdamW(model.parameters(), lr=task.warm_start_lr, weight_decay=0.0)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
            model.train()
            for _ in range(steps):
                batch = _examples(pieces, task, rng, task.warm_start_batch, task.history_mid_share)
                loss, _ = _loss(model, task, batch, range_ids, tokenizer.eos_token_id)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
        model.eval()
        metrics = {"steps": steps, "loss": None if loss is None else round(float(loss.detach()), 4)}
        with torch.no_grad():  # how well the model reads the hints: its guess distribution against the middle
            for label, share in (("mixed", task.history_mid_share), ("binary_search", 1.0)):
                batch = _examples(pieces, task, random.Random(seed + 7), 256, share)
                _, at_guess = _loss(model, task, batch, range_ids, tokenizer.eos_token_id)
                mid = batch[1][:, 2]
                metrics[f"{label}_greedy_middle"] = round(float((at_guess.argmax(-1) == mid).float().mean()), 4)
                metrics[f"{label}_p_middle"] = round(float(at_guess.gather(-1, mid[:, None]).exp().mean()), 4)
        return model, metrics


def _build(task: GuessTask, out_dir: str, params: dict) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp = synthetic.fresh_tmp(out_dir)
    try:
        t0 = time.perf_counter()
        rng = random.Random(params["seed"] * 1_000_003 + 23)
        for split in ("train", "val"):
            secrets = balanced_secrets(task, params[f"num_{split}_prompts"], rng)
            pq.write_table(pa.Table.from_pylist(rows(task, secrets, split)), os.path.join(tmp, f"{split}.parquet"))
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
