"""A teacher for a built-in single-turn task (`megappo.tasks.synthetic`): a larger model of another family (Llama,
hidden 96, 3 layers, against the student's Qwen2 of hidden 64, 2 layers) with the task's own tokenizer, warm-started
on the same training prompts with a sharper target (`smoothing` near 0), so that at temperature 1 it samples the
right answer most of the time while the student samples it ~23% of the time. On-policy distillation
(`recipes/cpu/tiny_distill.yaml`) then has something to teach without any task reward.

`prepare_teacher` writes `<out_dir>/model` (HF directory: config, safetensors, the task's tokenizer) and
`<out_dir>/manifest.json` (last: its presence means the model is whole), deterministically in `seed`, and reuses
them when the parameters match; concurrent callers serialise on `<out_dir>.lock`, as the task's own files do.
"""
from __future__ import annotations

import os
import random
import shutil
import time

from megappo.tasks.progress import announced
from megappo.tasks.synthetic import (
    _locked, _read_manifest, _warm_started_model, _write_tokenizer_and_config, fresh_tmp, get_task, held_out_split,
    swap_in,
)

FORMAT_VERSION = 1
# transformers.LlamaConfig fields: another family than the student's Qwen2 (no attention biases), larger; heads and
# layers still divide TP=2
TEACHER_MODEL = dict(hidden_size=96, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-6,
                     hidden_act="silu", initializer_range=0.05, attention_dropout=0.0, tie_word_embeddings=False)


def prepare_teacher(name: str, out_dir: str, *, smoothing: float, warm_start_steps: int, num_val_prompts: int,
                    seed: int = 0) -> str:
    """The directory of task `name`'s teacher (built, or reused when built with the same parameters). The
    validation prompts (drawn as the task draws them from `num_val_prompts` and `seed`) are held out of its warm
    start, as they are out of the student's."""
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"data.synthetic.teacher_smoothing must be in [0, 1), got {smoothing}")
    task = get_task(name)
    params = {"format": FORMAT_VERSION, "task": name, "smoothing": smoothing, "warm_start_steps": warm_start_steps,
              "num_val_prompts": num_val_prompts, "seed": seed, "model": TEACHER_MODEL}
    out_dir = os.path.abspath(os.path.expanduser(out_dir))
    model_dir = os.path.join(out_dir, "model")
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    with _locked(out_dir + ".lock"):
        manifest = _read_manifest(out_dir, files=())
        if manifest is None or manifest.get("params") != params:
            announced(f"teacher of {name}", warm_start_steps, out_dir, lambda: _build(task, out_dir, params))
    return model_dir


def _build(task, out_dir: str, params: dict) -> dict:
    import transformers

    tmp = fresh_tmp(out_dir)
    try:
        t0 = time.perf_counter()
        rng = random.Random(params["seed"] * 1_000_003 + 17)  # the task's own draw of its validation prompts
        val_codes, train_pools = held_out_split(task, rng, params["num_val_prompts"])
        model_tmp = os.path.join(tmp, "model")
        tokenizer, student_cfg = _write_tokenizer_and_config(task, model_tmp)
        cfg = transformers.LlamaConfig(vocab_size=student_cfg.vocab_size, eos_token_id=tokenizer.eos_token_id,
                                       pad_token_id=tokenizer.pad_token_id, bos_token_id=None, **TEACHER_MODEL)
        cfg.save_pretrained(model_tmp)  # over the student's config: the tokenizer files stay
        model, metrics = _warm_started_model(task, tokenizer, cfg, params["warm_start_steps"], params["seed"] + 7,
                                             val_codes, train_pools, smoothing=params["smoothing"],
                                             model_cls=transformers.LlamaForCausalLM)
        model.save_pretrained(model_tmp, safe_serialization=True)
        metrics["seconds"] = round(time.perf_counter() - t0, 2)
        manifest = {"params": params, "warm_start": metrics}
        swap_in(out_dir, tmp, manifest, files=())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest
