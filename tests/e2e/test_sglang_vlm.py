"""`SGLangEngine` on a real SGLang CPU server with a tiny Qwen2.5-VL (the colour_square task's files): image prompts
from the data loader get the in-process engine's greedy tokens and log-probs, and a weight reload from disk makes
the server answer what an engine on the new weights does; the CPU VLM recipe trains with rollout.name=sglang. (The
server starts in about a minute on 2 cores.)"""
from __future__ import annotations

import pytest

from megappo.rollout import HFEngine, SamplingParams
from megappo.rollout.sglang.engine import SGLangEngine
from megappo.rollout.sglang.server import SGLangServer
from megappo.testing.completions import assert_same_completions

pytestmark = [pytest.mark.e2e, pytest.mark.sglang, pytest.mark.long]
GREEDY = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)


def test_sglang_serves_a_vlm_like_the_in_process_engine(sglang_python, tmp_path):
    import transformers

    from megappo.data import PromptDataset
    from megappo.kinds.qwen2_vl.images import image_processing
    from megappo.tasks import prepare_task

    first, second = (prepare_task("colour_square", str(tmp_path / f"task{s}"), num_train_prompts=4,
                                  num_val_prompts=6, warm_start_steps=0, seed=s) for s in (0, 1))
    tok = transformers.AutoTokenizer.from_pretrained(first.model_dir)
    images = image_processing(first.model_dir, tok, min_pixels=3136, max_pixels=3136 * 4)
    batch = PromptDataset(first.val_files, tok, max_prompt_length=64, image_processing=images).collate(range(6))
    prompts = [ids[m.bool()].tolist() for ids, m in zip(batch.input_ids, batch.attention_mask)]
    with SGLangServer(first.model_dir, python=sglang_python) as server:
        engine = SGLangEngine(server.url, image_token_id=images.image_token_id)
        assert_same_completions(engine.generate(prompts, GREEDY, multi_modal=batch.multi_modal),
              HFEngine(first.model_dir).generate(prompts, GREEDY, multi_modal=batch.multi_modal))
        sampled = engine.generate(prompts, SamplingParams(max_new_tokens=3, temperature=1.0, n=2),
                                  multi_modal=batch.multi_modal)
        assert [len(g) for g in sampled] == [2] * 6
        assert engine.update_weights_from_disk(second.model_dir) == 1
        assert_same_completions(engine.generate(prompts, GREEDY, multi_modal=batch.multi_modal),
              HFEngine(second.model_dir).generate(prompts, GREEDY, multi_modal=batch.multi_modal))


def test_vlm_recipe_trains_on_sglang(sglang_python, tmp_path, monkeypatch):
    """The CPU VLM recipe with rollout.name=sglang: the trainer starts its server, image prompts are generated there,
    each step's sync sends the language model (the tower is frozen) and verify_sync finds the server scoring what
    the actor does; the server is stopped at the end."""
    import subprocess

    from megappo.config import load_config
    from megappo.testing.prompts import read_metrics
    from megappo.trainer import fit

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "run"
    cfg = load_config("recipes/cpu/tiny_vlm_ppo.yaml", [
        f"trainer.default_local_dir={out}", "trainer.total_training_steps=3", "trainer.test_freq=-1",
        "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.logger=[]",
        "data.synthetic.num_train_prompts=96", "data.synthetic.num_val_prompts=8",
        "actor_rollout_ref.rollout.name=sglang", f"actor_rollout_ref.rollout.server_python={sglang_python}",
        "actor_rollout_ref.rollout.verify_sync=true"])
    assert fit(cfg) == 0
    rows = [r for r in read_metrics(str(out)) if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["rollout/logprob_diff_mean"] < 1e-4 and r["rollout/verify_sync_max_diff"] < 1e-3, r
        assert r["rollout/weight_sync_bytes"] > 0
    ps = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True).stdout
    assert not [line for line in ps.splitlines() if "sglang.launch_server" in line and str(tmp_path) in line]
