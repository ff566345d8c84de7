"""digit_max on a tiny mixture-of-experts policy (Qwen3-MoE: 4 experts, top-2 in each of 2 layers), the task of
`recipes/cpu/tiny_moe_replay.yaml` (MoE router replay): the same prompts, answers, reward and warm start as
`megappo.tasks.synthetic`'s digit_max, another model family.

Its routers are close to ties, as large MoE policies' routers often are: in every layer experts 0..2 have the same
router row up to a relative `TIE_NOISE`, held through the warm start (the routers do not train there), so which of
them a token goes to is decided near float32 rounding and the rollout engine (transformers) and the trainer
(megatron) route some tokens differently: the gap router replay closes."""
from __future__ import annotations

import dataclasses
import os
import random
import shutil
import time

from megappo.tasks.synthetic import (
    TASKS as SINGLE_TURN, TaskFiles, _params, _warm_started_model, _write_parquet, _write_tokenizer_and_config,
    fresh_tmp, held_out_split, prepared, swap_in,
)

# transformers.Qwen3MoeConfig fields beside the task's Qwen2 ones: heads and layers divide TP=2, experts EP=2
MOE = dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1,
           mlp_only_layers=[], norm_topk_prob=True, router_aux_loss_coef=0.0)
TIE_NOISE = 1e-6
TASKS = {"digit_max_moe": dataclasses.replace(SINGLE_TURN["digit_max"], name="digit_max_moe")}


def prepare_task(name: str, out_dir: str, *, num_train_prompts: int = 1024, num_val_prompts: int = 64,
                 warm_start_steps: int = 200, seed: int = 0) -> TaskFiles:
    """`megappo.tasks.synthetic.prepare_task` with the MoE model."""
    task = TASKS[name]
    params = {**_params(task, num_train_prompts, num_val_prompts, warm_start_steps, seed), "moe": MOE,
              "tie_noise": TIE_NOISE}
    return prepared(task.name, task.data_source, out_dir, params, lambda d, p: _build(task, d, p))


def _tied_model(cfg):
    """A Qwen3-MoE whose routers' rows 0..2 are one row times (1 + TIE_NOISE * noise), frozen (see the module)."""
    import torch
    import transformers

    model = transformers.Qwen3MoeForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            w = layer.mlp.gate.weight  # [E, H]
            for e in range(3):
                w[e] = w[0] * (1 + TIE_NOISE * torch.randn(w.shape[1], generator=g))
            w.requires_grad_(False)
    return model


def _build(task, out_dir: str, params: dict) -> dict:
    import transformers

    tmp = fresh_tmp(out_dir)
    try:
        t0 = time.perf_counter()
        rng = random.Random(params["seed"] * 1_000_003 + 17)
        val_codes, train_pools = held_out_split(task, rng, params["num_val_prompts"])
        _write_parquet(task, os.path.join(tmp, "train.parquet"),
                       task.sample(rng, params["num_train_prompts"], train_pools, distinct=False), "train")
        _write_parquet(task, os.path.join(tmp, "val.parquet"), val_codes, "val")
        model_tmp = os.path.join(tmp, "model")
        tokenizer, dense = _write_tokenizer_and_config(task, model_tmp)
        cfg = transformers.Qwen3MoeConfig(vocab_size=dense.vocab_size, eos_token_id=tokenizer.eos_token_id,
                                          pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                                          **{**task.model, **MOE})
        cfg.save_pretrained(model_tmp)  # over the dense config: the tokenizer files stay
        model, metrics = _warm_started_model(task, tokenizer, cfg, params["warm_start_steps"], params["seed"],
                                             val_codes, train_pools, model_cls=_tied_model)
        model.save_pretrained(model_tmp, safe_serialization=True)
        metrics["seconds"] = round(time.perf_counter() - t0, 2)
        manifest = {"params": params, "data_source": task.data_source, "description": task.description,
                    "prompt_tokens": len(tokenizer(task.prompt(val_codes[0]))["input_ids"]),
                    "response_tokens": task.response_tokens, "warm_start": metrics}
        swap_in(out_dir, tmp, manifest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest
