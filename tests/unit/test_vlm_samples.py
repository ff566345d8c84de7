"""Vision-language samples through the trainer's bookkeeping: each sample keeps its prompt's images from the
rollout (`Samples.from_completions`) to the typed batch (`build_experience`) and through micro-batching, a
checkpoint's not-yet-trained samples (trainer_state.json) bring them back bit for bit, text samples are unchanged,
and preflight refuses what vision-language runs do not support, naming the key."""
from __future__ import annotations

import json

import pytest
import torch

from megappo.data.multimodal import MultiModalInputs
from megappo.models.microbatch import split_batch
from megappo.rollout.sampling import Completion
from megappo.trainer.experience import Samples, build_experience


def _prompts(images):
    from megappo.data.dataset import PromptBatch

    ids = torch.tensor([[0, 7, 500, 500, 8], [9, 10, 11, 12, 13]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    batch = PromptBatch(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                        raw_prompts=[[], []], data_sources=["s", "s"], ground_truths=["1", "2"],
                        extra_infos=[{}, {}], abilities=["a", "a"], indices=torch.tensor([3, 4]))
    batch.multi_modal = images  # the data loader's field (megappo.data.multimodal's contract)
    return batch


def _image(seed: int) -> MultiModalInputs:
    g = torch.Generator().manual_seed(seed)
    return MultiModalInputs(pixel_values=torch.randn(8, 12, generator=g), image_grid_thw=torch.tensor([[1, 2, 4]]))


def _samples(images) -> Samples:
    def comp(k, j, n):
        return Completion(prompt_index=k, output_ids=list(range(20, 20 + n)), log_probs=[-0.5] * n,
                          finish_reason="stop", weight_version=0)

    return Samples.from_completions(_prompts(images), [[comp(0, 0, 3), comp(0, 1, 5)], [comp(1, 0, 2), comp(1, 1, 4)]])


def test_images_travel_with_samples_and_rows():
    img = _image(0)
    s = _samples([img, None])
    assert s.multi_modal == [img, img, None, None] and s.has_images
    exp = build_experience(s, [3, 0, 2], pad_token_id=0)
    assert exp.batch.multi_modal == [None, img, None]
    plan = split_batch(exp.batch, micro_batch_size=2)
    assert [mb.multi_modal for mb in plan.micro_batches] == [[None, img], [None]]
    padded = plan.micro_batches[1].pad_to(3, plan.micro_batches[1].prompt_len, plan.micro_batches[1].response_len)
    assert padded.multi_modal == [None, None, None]
    assert s.select([1, 2]).multi_modal == [img, None]
    assert Samples.concat([s, s]).multi_modal == [img, img, None, None] * 2


def test_text_samples_unchanged():
    s = _samples(None)
    assert s.multi_modal == [None] * 4 and not s.has_images
    assert build_experience(s, [0, 1, 2, 3], pad_token_id=0).batch.multi_modal is None


def test_checkpointed_samples_keep_their_images():
    img = _image(1)
    s = _samples([img, None])
    back = Samples(**json.loads(json.dumps(s.to_json())))  # TrainState.ready through trainer_state.json
    assert back.response_ids == s.response_ids and back.multi_modal[2:] == [None, None]
    for m in back.multi_modal[:2]:
        assert torch.equal(m.pixel_values, img.pixel_values) and m.pixel_values.dtype == torch.float32
        assert torch.equal(m.image_grid_thw, img.image_grid_thw)
    old = {k: v for k, v in s.to_json().items() if k != "multi_modal"}  # saved before the field existed
    assert Samples(**old).multi_modal == [None] * 4


def test_preflight_refuses_unsupported_vlm_settings(tmp_path):
    from megappo.config import ConfigError, load_config
    from megappo.trainer.preflight import preflight

    hf_dir = tmp_path / "vlm"  # preflight reads config.json only
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "text_config": {
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4, "max_position_embeddings": 512}}))
    cfg = load_config("cpu/tiny_ppo", [
        f"actor_rollout_ref.model.path={hf_dir}", "data.synthetic.name=null",
        "actor_rollout_ref.actor.megatron.context_parallel_size=2", "actor_rollout_ref.model.lora.rank=4"])
    preflight(load_config("cpu/tiny_vlm_ppo"), world_size=1, check_files=False)  # the recipe passes
    with pytest.raises(ConfigError) as e:
        preflight(cfg, world_size=2, check_files=False)
    msg = str(e.value)
    assert "context_parallel_size=2: is not supported with a vision-language model" in msg
    assert "lora.rank: LoRA is not supported with a vision-language model" in msg
