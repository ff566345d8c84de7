"""Drives a `VLLMColocatedEngine` (a `vllm.LLM` in this process) through what the trainer asks of it and prints
one JSON object that tests/e2e/test_vllm_colocated.py compares with transformers. Run with the python of an
environment that has vLLM and the repository on PYTHONPATH (megappo's own environment cannot import vLLM):

    PYTHONPATH=. VLLM_CPU_KVCACHE_SPACE=1 VLLM_PY tests/e2e/vllm_colocated_check.py SPEC.json

SPEC: {"model": HF dir the engine starts on, "new": HF dir whose tensors arrive in buckets, "mixed_layer": a layer
index whose tensors are then loaded back from "model" alone (partial=True), "prompts", "sequences", "gpu": bool,
"lora_rank" and "adapter": a PEFT adapter dir of "model" served last (optional; the engine starts with LoRA on)};
or {"model": a vision-language model, "prompts", "images": per prompt its image files or null} (`images_main`).
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, replace
from typing import Any, Optional

from megappo.rollout.sampling import SamplingParams
from megappo.rollout.settings import AdapterServing, RolloutSettings


def settings(model: str, gpu: bool, lora_rank: Optional[int] = None) -> RolloutSettings:
    # CPU: vLLM's gpu_memory_utilization is the share of host memory it reserves (notes/vllm-cpu.md)
    kwargs: dict[str, Any] = {} if gpu else {"compilation_config": {"custom_ops": ["none"]}}
    return RolloutSettings(
        name="vllm", model_path=model, trust_remote_code=False, seed=0, hybrid_engine=True, max_num_seqs=8,
        engine_kwargs=kwargs, dtype="float32", tensor_model_parallel_size=1,
        gpu_memory_utilization=0.3 if gpu else 0.1, server_urls=(), servers_per_node=None, server_python=None,
        server_host="127.0.0.1", server_start_timeout_s=600, request_timeout_s=600, health_check_interval_s=0,
        health_check_timeout_s=5, restart_failed_servers=False, router="none", router_policy="round_robin",
        router_python=None, api_key=None, api_key_file=None, sync_timeout_s=600, weight_sync_master_address=None,
        lora_adapter=AdapterServing(lora_rank, ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))
        if lora_rank else None, mode="sync", enforce_eager=True, max_model_len=256, free_cache_engine=True)


def rows(groups) -> list[list[dict]]:
    return [[{k: v for k, v in asdict(c).items() if k != "routed_experts"} for c in g] for g in groups]


def buckets_of(model_dir: str, n: int, keep=lambda name: True) -> list[list]:
    """The checkpoint's tensors (HF names) in `n` buckets, each cut at a tensor, not at a layer."""
    from safetensors.torch import load_file

    items = [(k, t) for k, t in load_file(f"{model_dir}/model.safetensors").items() if keep(k)]
    size = -(-len(items) // n)
    return [items[i:i + size] for i in range(0, len(items), size)]


def engine_args_keys(model: str) -> list[str]:
    """The keys `engine_args` gives in its widest uses, each set built into vLLM's own `EngineArgs` (a key it lacks
    is a TypeError): deploy.py's colocated engine starts `vllm.LLM` with them."""
    import vllm

    from megappo.rollout.vllm.colocated import engine_args

    base = replace(settings(model, False), max_num_batched_tokens=512)
    variants = [engine_args(base, "bfloat16", routes=False, sleep_mode=False),
                engine_args(replace(base, lora_adapter=AdapterServing(8, ("linear_qkv",))), "float32", routes=True,
                            sleep_mode=True)]
    for kw in variants:
        vllm.EngineArgs(**kw)
    return sorted(set().union(*variants))


def failure(call) -> Optional[str]:
    try:
        call()
    except (RuntimeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def sleep_checks(engine: Any, spec: dict, out: dict, prompts: list, greedy: SamplingParams) -> None:
    """Where vLLM has sleep mode (GPU): released weights refuse what needs them (level 2) or come back on their own
    (level 1, a LoRA engine's), and a full sync after a release serves the synced weights."""
    import torch

    layer = f"model.layers.{int(spec['mixed_layer'])}."
    out["sleep_level"] = engine.sleep_level
    free_before = torch.cuda.mem_get_info()[0]
    out["released_again"] = engine.release_weights()
    out["freed_bytes"] = torch.cuda.mem_get_info()[0] - free_before  # sleep mode's pool is outside torch's counters
    out["generate_asleep"] = failure(lambda: engine.generate(prompts, greedy))
    out["partial_asleep"] = failure(lambda: engine.load_weights(
        iter(buckets_of(spec["model"], 1, lambda k: k.startswith(layer))), version=8, partial=True))
    out["version_after_sleep"] = engine.load_weights(iter(buckets_of(spec["model"], 3)), version=9)
    saved, engine.lora = engine.lora, None
    out["greedy_after_sleep"] = rows(engine.generate(prompts, greedy))
    engine.lora = saved


def main(spec: dict) -> dict:
    from megappo.rollout.vllm.colocated import VLLMColocatedEngine

    prompts, gpu = spec["prompts"], bool(spec.get("gpu"))
    out: dict[str, Any] = {"engine_args_keys": engine_args_keys(spec["model"])}
    greedy = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    engine = VLLMColocatedEngine(settings(spec["model"], gpu, spec.get("lora_rank")), "float32")
    out["init_s"] = time.perf_counter() - t0
    try:
        out["sleep_mode"] = engine.sleep_mode
        t0 = time.perf_counter()
        out["greedy"] = rows(engine.generate(prompts, greedy))
        out["first_generate_s"] = time.perf_counter() - t0
        sampled = SamplingParams(max_new_tokens=6, temperature=1.0, n=2, seed=7, ignore_eos=True)
        out["sampled"] = rows(engine.generate(prompts, sampled))
        out["sampled_again"] = rows(engine.generate(prompts, sampled))
        out["sampled_share"] = rows(engine.generate(prompts[1:], sampled, prompt_offset=1))
        out["sampled_other_seed"] = rows(engine.generate(prompts, SamplingParams(
            max_new_tokens=6, temperature=1.0, n=2, seed=8, ignore_eos=True)))
        stop = out["greedy"][0][0]["output_ids"][3]
        out["stop_token"] = stop
        out["until_stop"] = rows(engine.generate(prompts[:1], SamplingParams(
            max_new_tokens=8, temperature=0, stop_token_ids=(stop,))))
        out["sequence_log_probs"] = engine.sequence_log_probs(spec["sequences"])
        out["prompt_log_probs"] = engine.prompt_log_probs(spec["sequences"][0])
        out["released"] = engine.release_weights()

        loads = buckets_of(spec["new"], 3)
        t0 = time.perf_counter()
        out["version_new"] = engine.load_weights(iter(loads), version=3)
        out["load_s"] = time.perf_counter() - t0
        out["loaded_tensors"] = engine.loaded_tensors  # counted as the worker drew them: it runs in this process
        out["num_tensors"] = sum(len(b) for b in loads)
        out["greedy_new"] = rows(engine.generate(prompts, greedy))
        out["sequence_log_probs_new"] = engine.sequence_log_probs(spec["sequences"])

        layer = f"model.layers.{int(spec['mixed_layer'])}."
        out["version_mixed"] = engine.load_weights(iter(buckets_of(spec["model"], 2, lambda k: k.startswith(layer))),
                                                   version=4, partial=True)
        out["greedy_mixed"] = rows(engine.generate(prompts, greedy))
        out["sequence_log_probs_mixed"] = engine.sequence_log_probs(spec["sequences"])

        q_only = f"model.layers.{int(spec['mixed_layer'])}.self_attn.q_proj."  # vLLM fuses it with k and v
        out["split_load"] = failure(lambda: engine.load_weights(
            iter(buckets_of(spec["model"], 1, lambda k: k.startswith(q_only))), version=5, partial=True))
        out["version_disk"] = engine.update_weights_from_disk(spec["model"], version=5)
        out["greedy_disk"] = rows(engine.generate(prompts, greedy))
        if spec.get("adapter"):
            out["version_lora"] = engine.load_lora_adapter(spec["adapter"], version=6)
            out["greedy_lora"] = rows(engine.generate(prompts, greedy))
            out["sequence_log_probs_lora"] = engine.sequence_log_probs(spec["sequences"])
        if engine.sleep_mode:
            sleep_checks(engine, spec, out, prompts, greedy)
        try:
            engine.load_weights(iter([]), version=7)
        except ValueError as e:
            out["empty_load"] = str(e)
    finally:
        engine.close()
    return out


def images_main(spec: dict) -> dict:
    """A vision-language model's image prompts ("images": per prompt a list of image files, or null): the prompts'
    ids already hold the image tokens, the images go beside them as `multi_modal_data`."""
    from types import SimpleNamespace

    from PIL import Image

    from megappo.rollout.vllm.colocated import VLLMColocatedEngine

    prompts = spec["prompts"]
    # what the engine reads of a MultiModalInputs: the decoded images (vLLM processes them itself)
    multi_modal = [None if files is None else SimpleNamespace(images=[Image.open(f).convert("RGB") for f in files],
                                                              num_images=len(files)) for files in spec["images"]]
    # the model's own context length (colour_square's is 128)
    engine = VLLMColocatedEngine(replace(settings(spec["model"], bool(spec.get("gpu"))), max_model_len=None),
                                 spec.get("dtype", "float32"))
    try:
        greedy = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
        sampled = SamplingParams(max_new_tokens=3, temperature=1.0, n=2, seed=3, ignore_eos=True)
        return {"greedy": rows(engine.generate(prompts, greedy, multi_modal=multi_modal)),
                "sampled": rows(engine.generate(prompts, sampled, multi_modal=multi_modal))}
    finally:
        engine.close()


if __name__ == "__main__":  # vLLM may spawn processes that import this file
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    result = images_main(spec) if spec.get("images") else main(spec)
    print("MEGAPPO_RESULT " + json.dumps(result), flush=True)
