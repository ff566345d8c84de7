"""Built-in synthetic verifiable tasks: a tiny model, its tokenizer and its prompt sets, made locally in seconds.

The main CPU job (`megappo train --config recipes/cpu/tiny_ppo.yaml`) needs something to learn that exists right
after install: no download, no data directory. `prepare_task` writes, deterministically in `seed`,

    <out_dir>/model/          a tiny random-weight Qwen2 causal LM (Hugging Face directory: config, safetensors,
                              generation config) and a byte-level BPE tokenizer of 20 tokens (no chat template),
                              after a short supervised warm start
    <out_dir>/train.parquet   prompts in verl's schema (`megappo.data.PromptDataset` reads them)
    <out_dir>/val.parquet     prompts disjoint from the training ones
    <out_dir>/manifest.json   the parameters that made them (written last: its presence means the rest is whole)

and returns their paths as a `TaskFiles`. A second call with the same parameters reuses the files (a resumed run
keeps its reference model); different parameters rebuild them in place, with a warning.

Calling it: from one process while the others wait (torchrun: rank 0 calls it, then `broadcast_object_list` the
returned `TaskFiles`, or a barrier after which the other ranks call it too and get the reused files). Concurrent
calls on one machine (or on a filesystem with working `flock`) are also safe: a lock file `<out_dir>.lock` lets one
caller build while the others wait, then they reuse its output. Files appear atomically (temporary name, rename).
The bytes are the same for the same seed, CPU type and torch version (a written model is reused, not rebuilt).

The task: **digit_max** (data_source `megappo/digit_max`). The prompt is `max 3 9 1 4 =` (four random digits), the
answer the largest digit (`9`) followed by EOS. The reward (`synthetic_reward`, registered for every task's
data_source) is 1.0 for exactly the right answer and 0.0 otherwise: no format credit, so a rising reward is learning.

Prompts are 10 tokens, right answers 2, drawn so that the answers 1..9 are equally frequent (a constant scores 1/9,
not the 34% "9" would score on uniform digits); the validation prompts are held out of training and warm start.

The warm start trains with a smoothed target: the right digit with weight 1 - `smoothing` (0.85) and every digit
with `smoothing`/10, so after 200 steps (~8 s on 2 cores) the model knows the rule (its greedy answer is right on
~100% of prompts) but samples it at temperature 1 only ~23% of the time. RL then has a clear, quick job: make the
policy pick the answer it already ranks first (so validate by sampling at temperature 1: greedy is right from the
start). `digit_max_h32` is the same task on two heads of 32 dimensions.

This module imports neither torch nor pyarrow until `prepare_task` runs: reward worker processes import it (on
`megappo.rewards.registry`'s first look-up of a reward, through `builtin_rewards`) to find `synthetic_reward`.
"""
from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import random
import shutil
import tempfile
import time
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterator, Optional

from megappo.tasks.progress import announced

logger = logging.getLogger(__name__)

PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN)
DIGITS = tuple(str(d) for d in range(10))
MANIFEST = "manifest.json"
FORMAT_VERSION = 1  # bump when the files written for the same parameters change; old outputs are then rebuilt


@dataclass(frozen=True)
class SyntheticTask:
    """A task whose prompts are `num_items` random digits: everything `prepare_task` needs to build it."""

    name: str
    data_source: str
    description: str
    keyword: str  # the prompt's first word, e.g. "max"
    num_items: int  # digits per prompt
    answer_fn: Any  # tuple of digits -> the answer digit (an int in 0..9)
    # prompts are drawn with these answers, uniformly, so that no constant answer scores above 1/len(answers)
    answers: tuple[int, ...] = tuple(range(1, 10))
    # the tiny model (transformers.Qwen2Config fields); heads and layers divide TP=2 and PP=2
    model: dict = field(default_factory=lambda: dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-6, hidden_act="silu",
        initializer_range=0.05, attention_dropout=0.0, tie_word_embeddings=False,
    ))
    # supervised warm start: AdamW at `warm_start_lr` (cosine to 0), `warm_start_batch` examples a step, target =
    # (1 - smoothing) * the right digit + smoothing * uniform over the ten digits
    warm_start_lr: float = 3e-3
    warm_start_batch: int = 64
    smoothing: float = 0.85
    ability: str = "logic"

    def vocab_and_merges(self) -> tuple[list[str], list[tuple[str, str]]]:
        """The byte-level BPE tokens after the special tokens, and the merges that build the keyword.

        In the byte-level alphabet "Ġ" is a space. Qwen2's pre-tokenizer splits "max 3 9 1 4 =" into max, Ġ, 3, Ġ,
        9, Ġ, 1, Ġ, 4, Ġ= (digits alone, a space before a digit alone, a space before '=' with it).
        """
        if not (self.keyword.isascii() and self.keyword.isalpha() and self.keyword.islower()):
            raise ValueError(f"task {self.name!r}: the keyword must be lowercase ASCII letters, got {self.keyword!r}")
        tokens = list(DIGITS) + ["Ġ", "=", "Ġ="]
        merges = [("Ġ", "=")]
        for ch in self.keyword:
            if ch not in tokens:
                tokens.append(ch)
        for i in range(2, len(self.keyword) + 1):
            merges.append((self.keyword[:i - 1], self.keyword[i - 1]))
            tokens.append(self.keyword[:i])
        return tokens, merges

    @property
    def num_prompts(self) -> int:
        """How many distinct prompts exist."""
        return 10 ** self.num_items

    @property
    def response_tokens(self) -> int:
        """Tokens of a right answer: one digit and EOS (data.max_response_length should be at least this)."""
        return 2

    def spec(self) -> dict:
        """Everything that decides the files (for the manifest: a changed task is rebuilt, not reused)."""
        out = {k: v for k, v in asdict(self).items() if k not in ("description", "answer_fn")}
        out["answer_fn"] = getattr(self.answer_fn, "__name__", repr(self.answer_fn))
        out["answers"] = list(self.answers)
        return out

    def digits(self, code: int) -> tuple[int, ...]:
        """Prompt number `code` (0 <= code < num_prompts) as its digits."""
        return tuple(int(c) for c in f"{code:0{self.num_items}d}")

    def prompt(self, code: int) -> str:
        return " ".join((self.keyword, *map(str, self.digits(code)), "="))

    def answer(self, code: int) -> str:
        return str(self.answer_fn(self.digits(code)))

    def pools(self) -> dict[int, list[int]]:
        """answer -> the prompts (codes, ascending) that have it, for the answers prompts are drawn with."""
        pools: dict[int, list[int]] = {a: [] for a in self.answers}
        for code in range(self.num_prompts):
            a = self.answer_fn(self.digits(code))
            if a in pools:
                pools[a].append(code)
        return pools

    def sample(self, rng: random.Random, n: int, pools: dict[int, list[int]], *, distinct: bool) -> list[int]:
        """`n` prompts whose answers are uniform over the answers that `pools` still has prompts for.

        `distinct`: no prompt twice (each drawn one is removed from `pools`); otherwise prompts may repeat (a small
        answer has few prompts: 15 have the largest digit 1).
        """
        pools = {a: list(p) if distinct else p for a, p in pools.items() if p}
        out: list[int] = []
        while len(out) < n:
            if not pools:
                raise ValueError(f"task {self.name!r} has no more distinct prompts to draw")
            a = rng.choice(sorted(pools))
            i = rng.randrange(len(pools[a]))
            out.append(pools[a][i])
            if distinct:
                pools[a][i] = pools[a][-1]
                pools[a].pop()
                if not pools[a]:
                    del pools[a]
        return out


TASKS: dict[str, SyntheticTask] = {
    "digit_max": SyntheticTask(
        name="digit_max",
        data_source="megappo/digit_max",
        description="the prompt lists four digits ('max 3 9 1 4 ='); the answer is the largest ('9')",
        keyword="max",
        num_items=4,
        answer_fn=max,
    ),
}
# two heads of 32 dimensions (vLLM's CPU attention has no kernel for 16): the vLLM golden run's task
TASKS["digit_max_h32"] = replace(TASKS["digit_max"], name="digit_max_h32", model={
    **TASKS["digit_max"].model, "num_attention_heads": 2, "num_key_value_heads": 2})


def get_task(name: str) -> SyntheticTask:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown synthetic task {name!r}; set data.synthetic.name to one of "
                         f"{', '.join(sorted(TASKS))} (or null for none)") from None


# ---------------------------------------------------------------------------------------------------------------
# reward
# ---------------------------------------------------------------------------------------------------------------
def synthetic_reward(data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None
                     ) -> float:
    """1.0 when the response is exactly the answer (surrounding whitespace and EOS/pad tokens aside), else 0.0."""
    return exact_answer(solution_str, ground_truth, SPECIAL_TOKENS)


def exact_answer(text: str, ground_truth: Any, special_tokens) -> float:
    """Every built-in task's reward: 1.0 when `text` is exactly the answer once `special_tokens` and the
    surrounding whitespace are dropped, else 0.0 (no format credit, so a rising reward is learning)."""
    for token in special_tokens:
        text = text.replace(token, " ")
    return 1.0 if text.strip() == str(ground_truth).strip() else 0.0


def dataclass_params(name: str, task: Any, format_version: int, num_train_prompts: int, num_val_prompts: int,
                     warm_start_steps: int, seed: int) -> dict:
    """A dataclass task's manifest parameters (its fields but the description; tuples as the lists JSON reads back,
    so a reused build compares equal)."""
    from dataclasses import asdict

    spec = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(task).items() if k != "description"}
    return {"format": format_version, "task": name, "num_train_prompts": num_train_prompts,
            "num_val_prompts": num_val_prompts, "warm_start_steps": warm_start_steps, "seed": seed, "spec": spec}


def builtin_rewards() -> dict[str, Any]:
    """{data_source: reward function} of every task: `megappo.rewards.registry` registers them on its first look-up
    (this module does not import the registry, so neither imports the other at import time)."""
    return {t.data_source: synthetic_reward for t in TASKS.values()}


# ---------------------------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class TaskFiles:
    """Where `prepare_task` put a task's files; picklable (the trainer broadcasts it)."""

    model_dir: str  # HF directory: model and tokenizer (actor_rollout_ref.model.path, critic.model.path)
    train_files: str  # data.train_files
    val_files: str  # data.val_files
    data_source: str  # the prompts' data_source (synthetic_reward is registered for it)
    task: str = ""  # the task's name
    reused: bool = False  # True: the files were already there with the same parameters
    warm_start: dict = field(default_factory=dict)  # the warm-started model's metrics on the validation prompts


def _params(task: SyntheticTask, num_train_prompts: int, num_val_prompts: int, warm_start_steps: int,
            seed: int) -> dict:
    return {"format": FORMAT_VERSION, "task": task.name, "num_train_prompts": num_train_prompts,
            "num_val_prompts": num_val_prompts, "warm_start_steps": warm_start_steps, "seed": seed,
            "spec": task.spec()}


def _files(name: str, data_source: str, out_dir: str, manifest: dict, reused: bool) -> TaskFiles:
    return TaskFiles(
        model_dir=os.path.join(out_dir, "model"),
        train_files=os.path.join(out_dir, "train.parquet"),
        val_files=os.path.join(out_dir, "val.parquet"),
        data_source=data_source,
        task=name,
        reused=reused,
        warm_start=dict(manifest.get("warm_start", {})),
    )


def _read_manifest(out_dir: str, files: tuple[str, ...] = ("train.parquet", "val.parquet")) -> Optional[dict]:
    try:
        with open(os.path.join(out_dir, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    complete = all(os.path.exists(os.path.join(out_dir, p)) for p in
                   ("model/config.json", "model/model.safetensors", "model/tokenizer.json", *files))
    return manifest if complete and isinstance(manifest, dict) else None


def read_task_files(out_dir: str) -> Optional[TaskFiles]:
    """The TaskFiles of a complete output in `out_dir`, or None (nothing there, or a partial build)."""
    out_dir = os.path.abspath(os.path.expanduser(out_dir))
    manifest = _read_manifest(out_dir)
    if manifest is None or manifest.get("params", {}).get("task") not in TASKS:
        return None
    task = TASKS[manifest["params"]["task"]]
    return _files(task.name, task.data_source, out_dir, manifest, reused=True)


@contextmanager
def _locked(path: str) -> Iterator[None]:
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def prepare_task(name: str, out_dir: str, *, num_train_prompts: int = 1024, num_val_prompts: int = 64,
                 warm_start_steps: int = 200, seed: int = 0) -> TaskFiles:
    """Write task `name`'s warm-started model, tokenizer and train/val Parquet files under `out_dir` (see the module
    docstring); reuse them when `out_dir` already holds them for the same parameters. Returns their paths. Safe to
    call from several processes at once (they serialise on `<out_dir>.lock`); the usual pattern is rank 0 calling
    it while the other ranks wait, then sharing the returned `TaskFiles`."""
    task = get_task(name)
    for key, value, least in (("num_train_prompts", num_train_prompts, 1), ("num_val_prompts", num_val_prompts, 1),
                              ("warm_start_steps", warm_start_steps, 0)):
        if not isinstance(value, int) or value < least:
            raise ValueError(f"data.synthetic.{key} must be an integer >= {least}, got {value!r}")
    if num_val_prompts > task.num_prompts // 4:
        raise ValueError(f"task {name!r} has {task.num_prompts} distinct prompts; data.synthetic.num_val_prompts "
                         f"(distinct, held out of training) must be at most a quarter of them, got {num_val_prompts}")
    params = _params(task, num_train_prompts, num_val_prompts, warm_start_steps, seed)
    return prepared(task.name, task.data_source, out_dir, params, lambda d, p: _build(task, d, p))


def prepared(name: str, data_source: str, out_dir: str, params: dict, build: Callable[[str, dict], dict],
             steps: Optional[int] = None) -> TaskFiles:
    """Every task's locking, manifest and reuse: under `<out_dir>.lock`, the files in `out_dir` if made with `params`,
    else `build(out_dir, params)` (via `fresh_tmp`/`swap_in`; returns the manifest) and its `progress.announced`."""
    out_dir = os.path.abspath(os.path.expanduser(out_dir))
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    with _locked(out_dir + ".lock"):
        manifest = _read_manifest(out_dir)
        reused = manifest is not None and manifest.get("params") == params
        if not reused:
            if manifest is not None:
                logger.warning("%s holds task files made with %s; rebuilding them for %s", out_dir,
                               manifest.get("params"), params)
            manifest = announced(name, params.get("warm_start_steps", steps), out_dir, lambda: build(out_dir, params))
    return _files(name, data_source, out_dir, manifest, reused)


def fresh_tmp(out_dir: str) -> str:
    """A new build directory in `out_dir`, after removing those of builds that were killed (the caller holds the
    task's lock, so none is running)."""
    os.makedirs(out_dir, exist_ok=True)
    for entry in os.listdir(out_dir):
        if entry.startswith(".tmp-"):
            shutil.rmtree(os.path.join(out_dir, entry), ignore_errors=True)
    return tempfile.mkdtemp(prefix=".tmp-", dir=out_dir)


def swap_in(out_dir: str, tmp: str, manifest: dict, files: tuple[str, ...] = ("train.parquet", "val.parquet")
            ) -> None:
    """Move a finished build (`tmp`: `files` and model/) into `out_dir`. The manifest goes first and comes back last,
    so a crash in between leaves no valid manifest (the next call rebuilds) rather than one over mismatched files."""
    with suppress(FileNotFoundError):
        os.remove(os.path.join(out_dir, MANIFEST))
    for name in files:
        os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
    model_dir = os.path.join(out_dir, "model")
    if os.path.exists(model_dir):
        os.rename(model_dir, os.path.join(tmp, "old-model"))
    os.rename(os.path.join(tmp, "model"), model_dir)
    with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(os.path.join(tmp, MANIFEST), os.path.join(out_dir, MANIFEST))


def held_out_split(task: SyntheticTask, rng: random.Random, num_val: int) -> tuple[list[int], dict[int, list[int]]]:
    """(distinct validation codes, the training pools without them): the task's draw, which its teacher repeats."""
    pools = task.pools()
    val_codes = task.sample(rng, num_val, pools, distinct=True)
    held_out = set(val_codes)
    return val_codes, {a: [c for c in p if c not in held_out] for a, p in pools.items()}


def _build(task: SyntheticTask, out_dir: str, params: dict) -> dict:
    tmp = fresh_tmp(out_dir)
    try:
        t0 = time.perf_counter()
        rng = random.Random(params["seed"] * 1_000_003 + 17)
        val_codes, train_pools = held_out_split(task, rng, params["num_val_prompts"])
        train_codes = task.sample(rng, params["num_train_prompts"], train_pools, distinct=False)
        _write_parquet(task, os.path.join(tmp, "train.parquet"), train_codes, "train")
        _write_parquet(task, os.path.join(tmp, "val.parquet"), val_codes, "val")
        model_tmp = os.path.join(tmp, "model")
        tokenizer, config = _write_tokenizer_and_config(task, model_tmp)
        model, metrics = _warm_started_model(task, tokenizer, config, params["warm_start_steps"], params["seed"],
                                             val_codes, train_pools)
        model.save_pretrained(model_tmp, safe_serialization=True)
        metrics["seconds"] = round(time.perf_counter() - t0, 2)
        manifest = {"params": params, "data_source": task.data_source, "description": task.description,
                    "prompt_tokens": len(tokenizer(task.prompt(val_codes[0]))["input_ids"]),
                    "response_tokens": task.response_tokens,
                    "warm_start": metrics}
        swap_in(out_dir, tmp, manifest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def _rows(task: SyntheticTask, codes: list[int], split: str) -> list[dict]:
    return [{
        "data_source": task.data_source,
        "prompt": [{"role": "user", "content": task.prompt(code)}],
        "ability": task.ability,
        "reward_model": {"style": "rule", "ground_truth": task.answer(code)},
        "extra_info": {"split": split, "index": index, "task": task.name},
    } for index, code in enumerate(codes)]


def _write_parquet(task: SyntheticTask, path: str, codes: list[int], split: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64()), ("task", pa.string())])),
    ])
    pq.write_table(pa.Table.from_pylist(_rows(task, codes, split), schema=schema), path, row_group_size=1024)


def _write_tokenizer_and_config(task: SyntheticTask, model_dir: str):
    """Write the tokenizer and the model config to `model_dir`; return (the tokenizer as `AutoTokenizer` loads it
    back, the config).

    The tokenizer is a Qwen2 byte-level BPE over the task's few tokens, without a chat template (the dataset then
    tokenises the message text as it is): `AutoTokenizer` loads a qwen2 model's tokenizer as `Qwen2Tokenizer` whatever
    tokenizer.json holds, so it is built as one. The warm start uses the loaded-back tokenizer, the one the trainer
    and the rollout engines will use.
    """
    import transformers

    tokens, merges = task.vocab_and_merges()
    vocab = {w: i for i, w in enumerate(SPECIAL_TOKENS + tuple(tokens))}
    tokenizer = transformers.Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
                                            unk_token=PAD_TOKEN, bos_token=None,
                                            model_max_length=task.model["max_position_embeddings"])
    config = transformers.Qwen2Config(vocab_size=len(vocab), eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id, bos_token_id=None, **task.model)
    os.makedirs(model_dir, exist_ok=True)
    tokenizer.save_pretrained(model_dir)
    config.save_pretrained(model_dir)
    loaded = transformers.AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)  # our own files
    prompt = task.prompt(0)
    if loaded.eos_token_id != tokenizer.eos_token_id or loaded(prompt)["input_ids"] != tokenizer(prompt)["input_ids"]:
        raise RuntimeError(f"the synthetic task's tokenizer does not survive a save and load with transformers "
                           f"{transformers.__version__} (loaded as {type(loaded).__name__})")
    return loaded, config


@contextmanager
def _one_thread() -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # deterministic reductions, and faster than 2 threads for a model this small
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _warm_started_model(task: SyntheticTask, tokenizer, cfg, steps: int, seed: int, val_codes: list[int],
                        train_pools: dict[int, list[int]], smoothing: Optional[float] = None, model_cls=None):
    import torch  # smoothing: the target's (None: the task's); model_cls: None is Qwen2ForCausalLM
    import transformers

    smoothing = task.smoothing if smoothing is None else smoothing
    model_cls = model_cls or transformers.Qwen2ForCausalLM
    with _one_thread(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(cfg).float()
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        digit_ids = torch.tensor(tokenizer.convert_tokens_to_ids(list(DIGITS)))
        eos = tokenizer.eos_token_id
        p = len(tokenizer(task.prompt(0))["input_ids"])  # every prompt has this many tokens

        def batch(codes: list[int]) -> torch.Tensor:
            ids = tokenizer([task.prompt(c) for c in codes])["input_ids"]
            answers = tokenizer.convert_tokens_to_ids([task.answer(c) for c in codes])
            if any(len(i) != p for i in ids):
                raise RuntimeError(f"task {task.name!r}: prompts tokenise to different lengths")
            return torch.tensor([i + [a, eos] for i, a in zip(ids, answers)])

        rng = random.Random(seed * 1_000_003 + 29)
        if steps > 0:
            opt = torch.optim.AdamW(model.parameters(), lr=task.warm_start_lr, weight_decay=0.0)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
            model.train()
            for _ in range(steps):
                x = batch(task.sample(rng, task.warm_start_batch, train_pools, distinct=False))
                logq = torch.log_softmax(model(input_ids=x).logits[:, p - 1:-1].float(), dim=-1)  # [B, 2, V]
                nll = -logq.gather(-1, x[:, p:, None])[..., 0]  # answer digit, EOS
                spread = -logq[:, 0, digit_ids].mean(-1)  # uniform over the ten digits
                loss = ((1 - smoothing) * nll[:, 0] + smoothing * spread + nll[:, 1]).mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
        model.eval()
        with torch.no_grad():
            x = batch(val_codes)
            probs = torch.softmax(model(input_ids=x).logits[:, p - 1:p + 1].float(), dim=-1)  # [B, 2, V]
            right = probs[:, 0].gather(-1, x[:, p, None])[:, 0]
            metrics = {
                "steps": steps,
                # the chance that a temperature-1 sample is exactly right (answer digit, then EOS): the expected
                # reward/mean of the first PPO steps
                "val_expected_reward_t1": round(float((right * probs[:, 1, eos]).mean()), 4),
                "val_greedy_accuracy": round(float((probs[:, 0].argmax(-1) == x[:, p]).float().mean()), 4),
            }
    return model, metrics
