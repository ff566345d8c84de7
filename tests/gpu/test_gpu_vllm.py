"""vLLM's colocated engine (rollout.mode=sync, `VLLMColocatedEngine`) on a GPU: what the CPU can't show. Sleep mode
(free_cache_engine: level 2 frees weights and KV cache until the next full sync; level 1, a LoRA engine's, keeps the
weights in host memory and wakes on its own), then the CPU test's checks on CUDA (bucketed and partial syncs, disk,
a LoRA adapter), and image prompts of a vision-language model. Run with `pytest -m gpu tests/gpu` where vLLM 0.32
is installed for CUDA: in this Python or in the one MEGAPPO_VLLM_PYTHON names (vLLM pins transformers < 5.20, so
usually a venv of its own). The CPU test of the rest is tests/e2e/test_vllm_colocated.py, whose helpers these reuse.

On CUDA the engine's float32 kernels are not transformers' CPU ones and the tiny random models' logits lie close
together, so greedy tokens may part at a near-tie: the checks score the engine's own tokens with transformers
(teacher forcing) and compare log-probs, which a wrong or stale weight moves by far more than the tolerance.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megappo.testing.completions import assert_scored_alike

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from test_vllm_colocated import MIXED_LAYER, PROMPTS, SEQUENCES, make_models  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]
REPO = Path(__file__).resolve().parents[2]
ATOL = 2e-3  # float32 CUDA engine vs float32 transformers on CPU


@pytest.fixture(scope="module")
def cuda_vllm_python() -> str:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    python = os.environ.get("MEGAPPO_VLLM_PYTHON", sys.executable)
    probe = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"vLLM is not installed for {python} (set MEGAPPO_VLLM_PYTHON): {probe.stderr[-300:]}")
    return python


def run_check(python: str, spec: dict, tmp_path: Path) -> dict:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({**spec, "gpu": True}))
    proc = subprocess.run([python, str(REPO / "tests/e2e/vllm_colocated_check.py"), str(path)], capture_output=True,
                          text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("MEGAPPO_RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(lines[-1].removeprefix("MEGAPPO_RESULT "))


def assert_scored_like(groups: list, model_dir: str, prompts: list, multi_modal=None) -> None:
    assert_scored_alike(groups, model_dir, prompts, ATOL, multi_modal)


@pytest.fixture(scope="module")
def cpu_test_models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("vllm_colocated_gpu"))


@pytest.mark.parametrize("lora", [False, True], ids=["level2", "lora_level1"])
def test_colocated_engine_sleeps_between_rollouts_and_serves_each_sync(cuda_vllm_python, cpu_test_models, lora,
                                                                       tmp_path):
    m, prompts = cpu_test_models, PROMPTS
    spec = {"model": m["model"], "new": m["new"], "mixed_layer": MIXED_LAYER, "prompts": prompts,
            "sequences": SEQUENCES}
    if lora:
        spec.update(lora_rank=8, adapter=m["adapter"])
    got = run_check(cuda_vllm_python, spec, tmp_path)
    assert got["sleep_mode"] is True and got["released"] is True and got["released_again"] is True
    assert got["sleep_level"] == (1 if lora else 2) and got["freed_bytes"] > 0
    if lora:  # level 1 kept the weights: generating and partial syncs wake the engine
        assert got["generate_asleep"] is None and got["partial_asleep"] is None
    else:
        assert "release_weights" in got["generate_asleep"] and "level-2" in got["partial_asleep"]
    assert got["version_after_sleep"] == 9
    assert [[c["output_ids"] for c in g] for g in got["greedy_after_sleep"]] == \
        [[c["output_ids"] for c in g] for g in got["greedy"]]
    assert_scored_like(got["greedy"], m["model"], prompts)
    assert_scored_like(got["greedy_new"], m["new"], prompts)
    assert_scored_like(got["greedy_mixed"], m["mixed"], prompts)
    assert_scored_like(got["sampled"], m["model"], prompts)
    if lora:
        assert_scored_like(got["greedy_lora"], m["merged"], prompts)
    assert got["loaded_tensors"] == got["num_tensors"]


def test_colocated_engine_generates_from_image_prompts(cuda_vllm_python, tmp_path):
    """The colour_square task's tiny Qwen2.5-VL: the data loader's image prompts (ids holding the image tokens) and
    their images go to vLLM as multi_modal_data; transformers scores the tokens it answers alike."""
    import transformers

    from megappo.data import PromptDataset
    from megappo.kinds.qwen2_vl.images import image_processing
    from megappo.tasks import prepare_task

    task = prepare_task("colour_square", str(tmp_path / "task"), num_train_prompts=4, num_val_prompts=4,
                        warm_start_steps=0, seed=0)
    tok = transformers.AutoTokenizer.from_pretrained(task.model_dir)
    images = image_processing(task.model_dir, tok, min_pixels=3136, max_pixels=3136 * 4)
    batch = PromptDataset(task.val_files, tok, max_prompt_length=64, image_processing=images).collate(range(4))
    prompts = [ids[m.bool()].tolist() for ids, m in zip(batch.input_ids, batch.attention_mask)]
    files = []
    for k, mm in enumerate(batch.multi_modal):
        names = [str(tmp_path / f"image{k}_{j}.png") for j in range(len(mm.images))] if mm is not None else None
        for name, image in zip(names or (), mm.images if mm is not None else ()):
            image.save(name)
        files.append(names)
    assert any(files)
    got = run_check(cuda_vllm_python, {"model": task.model_dir, "prompts": prompts, "images": files}, tmp_path)
    assert [len(g) for g in got["sampled"]] == [2] * len(prompts)
    assert_scored_like(got["greedy"], task.model_dir, prompts, batch.multi_modal)
    assert_scored_like(got["sampled"], task.model_dir, prompts, batch.multi_modal)
