"""A built-in vision-language task: **colour_square** (data_source `megappo/colour_square`).

The prompt is a 56x56 image with three squares of different colours (one large, two small ones drawn over it) and
the text `<image> which colour is the largest square?`; the answer is the large square's colour word (`red`,
`green`, `blue` or `yellow`) followed by EOS. The reward (`colour_square_reward`) is 1.0 for exactly that, else 0.0.
Answers are uniform over the four colours, so a constant answer scores 0.25.

`prepare_task` writes, like `megappo.tasks.synthetic` (same manifest, locking, reuse and atomic swap):

    <out_dir>/model/          a tiny random-weight Qwen2.5-VL (config, safetensors, generation config), its tokenizer
                              (byte-level BPE alphabet, the prompt's words and colours as added tokens, Qwen's vision
                              special tokens, no chat template) and preprocessor_config.json (Qwen2-VL image
                              processor, 14 px patches merged 2x2: an image is 4 tokens), after a supervised warm start
    <out_dir>/train.parquet   prompts in the multimodal schema (megappo.data.multimodal), images as PNG bytes
    <out_dir>/val.parquet     held-out prompts (distinct images)
    <out_dir>/manifest.json

The warm start (AdamW, cosine) trains on freshly drawn images with a smoothed target: the right colour with weight
1 - `smoothing` (0.9) and each colour with `smoothing`/4, so the model ranks the right colour first but samples it
at temperature 1 only about a third of the time; RL then has to sharpen it. Validate by sampling at temperature 1.

Imports neither torch nor pyarrow at import time (reward workers import it).
"""
from __future__ import annotations

import io
import math
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from megappo.tasks import synthetic
from megappo.tasks.synthetic import TaskFiles, _one_thread

FORMAT_VERSION = 1
PAD, EOS = "<|endoftext|>", "<|im_end|>"
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
SPECIAL = (PAD, EOS, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (230, 200, 30)}
QUESTION = "<image> which colour is the largest square?"
WORDS = ("which", "colour", "is", "the", "largest", "square")


@dataclass(frozen=True)
class ColourSquareTask:
    name: str = "colour_square"
    data_source: str = "megappo/colour_square"
    description: str = "an image with three coloured squares; the answer is the largest square's colour ('red')"
    image_size: int = 56  # pixels a side: 4x4 patches of 14 px, 2x2 merged -> 4 image tokens
    big: tuple[int, int] = (30, 42)  # side of the large square, pixels
    small: tuple[int, int] = (6, 12)  # sides of the two small squares
    smoothing: float = 0.88
    warm_start_lr: float = 5e-3
    warm_start_batch: int = 32
    ability: str = "vision"
    model_type: str = "qwen2_5_vl"  # of the model it writes: the run's model kind (`megappo.kinds`)
    # the tiny model; text heads and layers divide TP=2 and PP=2
    model: dict = field(default_factory=lambda: dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, rms_norm_eps=1e-6, initializer_range=0.05))
    vision: dict = field(default_factory=lambda: dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1],
        initializer_range=0.05))

    @property
    def response_tokens(self) -> int:
        return 2  # the colour word and EOS

    def draw(self, rng: random.Random) -> tuple[bytes, str]:
        """One image (PNG bytes) and its answer."""
        from PIL import Image, ImageDraw

        names = rng.sample(sorted(COLOURS), 3)
        img = Image.new("RGB", (self.image_size, self.image_size), (255, 255, 255))
        draw = ImageDraw.Draw(img)
        for k, name in enumerate(names):  # the large one first, so the small ones lie over it
            side = rng.randint(*(self.big if k == 0 else self.small))
            x, y = rng.randint(0, self.image_size - side), rng.randint(0, self.image_size - side)
            draw.rectangle([x, y, x + side - 1, y + side - 1], fill=COLOURS[name])
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        return buf.getvalue(), names[0]


TASKS: dict[str, ColourSquareTask] = {"colour_square": ColourSquareTask()}


def colour_square_reward(data_source: str, solution_str: str, ground_truth: Any,
                         extra_info: Optional[dict] = None) -> float:
    """1.0 when the response is exactly the colour (whitespace and EOS/pad aside), else 0.0."""
    return synthetic.exact_answer(solution_str, ground_truth, (EOS, PAD))


def builtin_rewards() -> dict[str, Any]:
    return {t.data_source: colour_square_reward for t in TASKS.values()}


def prepare_task(name: str, out_dir: str, *, num_train_prompts: int = 1024, num_val_prompts: int = 64,
                 warm_start_steps: int = 200, seed: int = 0) -> TaskFiles:
    """`megappo.tasks.synthetic.prepare_task` for the image task (same files, manifest, locking and reuse)."""
    task = TASKS[name]
    params = synthetic.dataclass_params(name, task, FORMAT_VERSION, num_train_prompts, num_val_prompts,
                                        warm_start_steps, seed)
    return synthetic.prepared(name, task.data_source, out_dir, params, lambda d, p: _build(task, d, p))


def write_model_files(task: ColourSquareTask, model_dir: str):
    """Write the tokenizer, model config and image processor config; return (tokenizer as loaded back, config)."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from megappo.tasks.tool_sum import _byte_alphabet

    vocab = {w: i for i, w in enumerate(SPECIAL + _byte_alphabet())}
    tok = transformers.Qwen2Tokenizer(vocab=vocab, merges=[], eos_token=EOS, pad_token=PAD, unk_token=PAD,
                                      bos_token=None, model_max_length=task.model["max_position_embeddings"])
    tok.add_special_tokens({"additional_special_tokens": list(SPECIAL[2:])})
    tok.add_tokens(list(WORDS) + sorted(COLOURS))
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    text = dict(task.model, vocab_size=len(tok), eos_token_id=ids[EOS], pad_token_id=ids[PAD], bos_token_id=None,
                rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[2, 3, 3]))
    config = transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config=dict(task.vision), image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD], vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END],
        eos_token_id=ids[EOS], pad_token_id=ids[PAD], bos_token_id=None, tie_word_embeddings=False)
    os.makedirs(model_dir, exist_ok=True)
    tok.save_pretrained(model_dir)
    config.save_pretrained(model_dir)
    v = task.vision
    Qwen2VLImageProcessorPil(patch_size=v["patch_size"], merge_size=v["spatial_merge_size"],
                             temporal_patch_size=v["temporal_patch_size"], min_pixels=task.image_size ** 2,
                             max_pixels=task.image_size ** 2 * 4).save_pretrained(model_dir)
    loaded = transformers.AutoTokenizer.from_pretrained(model_dir)
    for word in sorted(COLOURS):
        if loaded.encode(word, add_special_tokens=False) != [tok.convert_tokens_to_ids(word)]:
            raise RuntimeError(f"the colour_square tokenizer does not keep '{word}' one token "
                               f"({type(loaded).__name__})")
    return loaded, config


def _examples(task: ColourSquareTask, tokenizer, images, rng: random.Random, n: int):
    """n fresh (input_ids [n, P+2], pixel_values, image_grid_thw, position_ids [3, n, P+2], P) with the answers."""
    import torch

    from megappo.data.images import ImageSource
    from megappo.kinds import kind_of

    drawn = [task.draw(rng) for _ in range(n)]
    mm = images.inputs([ImageSource(b, None, "<warm start>", 0, "images") for b, _ in drawn])
    tokens = mm.image_grid_thw[0].prod().item() // images.merge_size ** 2
    text = images.expand(QUESTION, [tokens], "<warm start>", 0, "images", "prompt")
    prompt = tokenizer(text)["input_ids"]
    ids = torch.tensor([prompt + tokenizer.convert_tokens_to_ids([a, EOS]) for _, a in drawn])
    pos = kind_of({"model_type": task.model_type}).position_ids(ids, mm.image_grid_thw, images.image_token_id,
                                                                images.merge_size)
    return ids, mm.pixel_values, mm.image_grid_thw, pos, len(prompt)


def warm_start(task: ColourSquareTask, tokenizer, config, images, steps: int, seed: int, val_rng: random.Random):
    import torch
    import transformers

    with _one_thread(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen2_5_VLForConditionalGeneration(config).float()
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        colour_ids = torch.tensor(tokenizer.convert_tokens_to_ids(sorted(COLOURS)))
        eos = tokenizer.eos_token_id

        def answer_logq(ids, pix, grid, pos, p):
            logits = model(input_ids=ids, pixel_values=pix, image_grid_thw=grid, position_ids=pos).logits
            return torch.log_softmax(logits[:, p - 1:p + 1].float(), dim=-1)  # [B, 2, V]: colour, EOS

        rng = random.Random(seed * 1_000_003 + 31)
        if steps > 0:
            opt = torch.optim.AdamW(model.parameters(), lr=task.warm_start_lr, weight_decay=0.0)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
            model.train()
            for _ in range(steps):
                ids, pix, grid, pos, p = _examples(task, tokenizer, images, rng, task.warm_start_batch)
                logq = answer_logq(ids, pix, grid, pos, p)
                nll = -logq.gather(-1, ids[:, p:, None])[..., 0]
                spread = -logq[:, 0, colour_ids].mean(-1)
                loss = ((1 - task.smoothing) * nll[:, 0] + task.smoothing * spread + nll[:, 1]).mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
        model.eval()
        with torch.no_grad():
            ids, pix, grid, pos, p = _examples(task, tokenizer, images, val_rng, 64)
            probs = answer_logq(ids, pix, grid, pos, p).exp()
            right = probs[:, 0].gather(-1, ids[:, p, None])[:, 0]
            metrics = {"steps": steps,
                       "val_expected_reward_t1": round(float((right * probs[:, 1, eos]).mean()), 4),
                       "val_greedy_accuracy": round(float((probs[:, 0].argmax(-1) == ids[:, p]).float().mean()), 4)}
    return model, metrics


def _write_parquet(task: ColourSquareTask, path: str, rows: list[tuple[bytes, str]], split: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64()), ("task", pa.string())])),
    ])
    table = [{"data_source": task.data_source, "prompt": [{"role": "user", "content": QUESTION}],
              "images": [{"bytes": png, "path": None}], "ability": task.ability,
              "reward_model": {"style": "rule", "ground_truth": answer},
              "extra_info": {"split": split, "index": i, "task": task.name}} for i, (png, answer) in enumerate(rows)]
    pq.write_table(pa.Table.from_pylist(table, schema=schema), path, row_group_size=1024)


def _build(task: ColourSquareTask, out_dir: str, params: dict) -> dict:
    from megappo.kinds import kind_of

    tmp = synthetic.fresh_tmp(out_dir)
    try:
        t0 = time.perf_counter()
        rng = random.Random(params["seed"] * 1_000_003 + 23)
        val = []
        seen = set()
        while len(val) < params["num_val_prompts"]:
            png, answer = task.draw(rng)
            if png not in seen:
                seen.add(png)
                val.append((png, answer))
        train = []
        while len(train) < params["num_train_prompts"]:
            png, answer = task.draw(rng)
            if png not in seen:  # held-out images stay out of training
                train.append((png, answer))
        _write_parquet(task, os.path.join(tmp, "train.parquet"), train, "train")
        _write_parquet(task, os.path.join(tmp, "val.parquet"), val, "val")
        model_tmp = os.path.join(tmp, "model")
        tokenizer, config = write_model_files(task, model_tmp)
        images = kind_of(model_tmp).image_processing(model_tmp, tokenizer, min_pixels=task.image_size ** 2,
                                                     max_pixels=task.image_size ** 2 * 4)
        model, metrics = warm_start(task, tokenizer, config, images, params["warm_start_steps"], params["seed"],
                                    random.Random(params["seed"] * 1_000_003 + 37))
        model.save_pretrained(model_tmp, safe_serialization=True)
        metrics["seconds"] = round(time.perf_counter() - t0, 2)
        manifest = {"params": params, "data_source": task.data_source, "description": task.description,
                    "response_tokens": task.response_tokens, "warm_start": metrics}
        synthetic.swap_in(out_dir, tmp, manifest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest
