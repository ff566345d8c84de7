"""The built-in image task: its files (a Qwen2.5-VL directory whose tokenizer and image processor load with
transformers, multimodal Parquet the data loader reads), its reward, reuse, and (long) that RL can learn it."""
from __future__ import annotations

import json
import os
import random

import pytest
import torch

from megappo.tasks import TASKS, prepare_task
from megappo.tasks.colour_square import COLOURS, colour_square_reward


def test_colour_square_files_load_and_reward(tmp_path):
    from megappo.data import PromptDataset
    from megappo.kinds.qwen2_vl.images import image_processing
    from megappo.rewards.registry import get_reward_fn

    files = prepare_task("colour_square", str(tmp_path / "task"), num_train_prompts=16, num_val_prompts=8,
                         warm_start_steps=2, seed=3)
    assert "colour_square" in TASKS and not files.reused
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(files.model_dir)
    image_proc = transformers.AutoImageProcessor.from_pretrained(files.model_dir)
    assert image_proc.merge_size == 2 and image_proc.patch_size == 14
    images = image_processing(files.model_dir, tok, min_pixels=3136, max_pixels=3136 * 4)
    ds = PromptDataset(files.val_files, tok, max_prompt_length=64, image_processing=images)
    batch = ds.collate(list(range(len(ds))))
    assert len(ds) == 8 and all(m.image_grid_thw.tolist() == [[1, 4, 4]] for m in batch.multi_modal)
    assert all(gt in COLOURS for gt in batch.ground_truths)
    assert (batch.input_ids == images.image_token_id).sum(-1).tolist() == [4] * 8
    # the answers are single tokens followed by EOS, and the reward is exact match
    for colour in COLOURS:
        assert len(tok.encode(colour, add_special_tokens=False)) == 1
    fn = get_reward_fn(files.data_source)
    assert fn(files.data_source, "red<|im_end|>", "red") == 1.0
    assert fn(files.data_source, " blue ", "blue") == 1.0
    assert colour_square_reward(files.data_source, "red green", "red") == 0.0
    manifest = json.load(open(os.path.join(tmp_path / "task", "manifest.json")))
    assert manifest["warm_start"]["steps"] == 2
    again = prepare_task("colour_square", str(tmp_path / "task"), num_train_prompts=16, num_val_prompts=8,
                         warm_start_steps=2, seed=3)
    assert again.reused


@pytest.mark.long
def test_colour_square_warm_start_and_rl_learns(tmp_path):
    """The default warm start leaves a temperature-1 reward of ~0.3; REINFORCE through the HF engine's samples
    (64 a step, Adam 1e-3) raises it by >= 0.25 within 20 steps."""
    import transformers

    from megappo.data import PromptDataset
    from megappo.kinds.qwen2_vl.images import image_processing
    from megappo.kinds.qwen2_vl.rope_index import mrope_position_ids
    from megappo.rollout import HFEngine, SamplingParams

    files = prepare_task("colour_square", str(tmp_path / "task"), num_train_prompts=512, num_val_prompts=64)
    assert 0.15 <= files.warm_start["val_expected_reward_t1"] <= 0.45
    assert files.warm_start["val_greedy_accuracy"] >= 0.6
    tok = transformers.AutoTokenizer.from_pretrained(files.model_dir)
    images = image_processing(files.model_dir, tok, min_pixels=3136, max_pixels=3136 * 4)
    ds = PromptDataset(files.train_files, tok, max_prompt_length=64, image_processing=images)
    engine = HFEngine(files.model_dir, max_num_seqs=64)
    model = engine.model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rng = random.Random(0)
    rewards = []
    for step in range(20):
        batch = ds.collate(rng.sample(range(len(ds)), 64))
        prompts = [ids[m.bool()].tolist() for ids, m in zip(batch.input_ids, batch.attention_mask)]
        with torch.no_grad():
            out = engine.generate(prompts, SamplingParams(max_new_tokens=3, temperature=1.0, seed=step),
                                  multi_modal=batch.multi_modal)
        r = torch.tensor([colour_square_reward("", tok.decode(c[0].output_ids), gt)
                          for c, gt in zip(out, batch.ground_truths)])
        rewards.append(float(r.mean()))
        loss = 0.0
        for k, (p, (c,), mm) in enumerate(zip(prompts, out, batch.multi_modal)):
            ids = torch.tensor([p + c.output_ids])
            pos = mrope_position_ids(ids, mm.image_grid_thw, images.image_token_id, images.merge_size)
            logits = model(input_ids=ids, position_ids=pos, pixel_values=mm.pixel_values,
                           image_grid_thw=mm.image_grid_thw).logits[0, len(p) - 1:-1]
            logp = torch.log_softmax(logits.float(), -1).gather(1, ids[0, len(p):, None]).sum()
            loss = loss - (r[k] - r.mean()) * logp / len(prompts)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert sum(rewards[-4:]) / 4 - sum(rewards[:4]) / 4 >= 0.25, rewards
