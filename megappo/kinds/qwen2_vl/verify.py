"""`verify` for Qwen2.5-VL / Qwen2-VL: random images of different sizes through the HF image processor, then the
same batch through transformers' model and the megatron chunks (any TP/PP layout); logits compared on the real
(unpadded) tokens.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from megappo.convert.collectives import last_stage_output
from megappo.kinds.qwen2_vl.config import read_vlm_config
from megappo.models.hf_config import load_hf_config_dict

DEFAULT_SIZES = ((56, 84), (112, 56), (140, 112))  # (height, width) in pixels: 4x6, 8x4, 10x8 patches of 14


def image_batch(hf_config: Any, sizes=DEFAULT_SIZES, seed: int = 0, max_pixels: int = 28 * 28 * 64
                ) -> dict[str, torch.Tensor]:
    """One random RGB image per row (hf_config: directory, dict or config object), processed by the real Qwen2-VL image processor, with text around it.

    Returns input_ids [B, T] (right-padded with 0: text, vision_start, image placeholders, vision_end, text),
    attention_mask [B, T], pixel_values [N, 3 * tp * p * p] float32, image_grid_thw [B, 3].
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    args = read_vlm_config(hf_config)
    v = args.vision
    cfg = load_hf_config_dict(hf_config)
    start = int(cfg.get("vision_start_token_id", args.image_token_id - 1))
    end = int(cfg.get("vision_end_token_id", args.image_token_id - 2))
    vocab = int(args.text_config["vocab_size"])
    avoid = {args.image_token_id, start, end, args.video_token_id}
    rng = np.random.default_rng(seed)
    proc = Qwen2VLImageProcessorPil(patch_size=v.patch_size, merge_size=v.spatial_merge_size,
                                    temporal_patch_size=v.temporal_patch_size,
                                    min_pixels=(v.patch_size * v.spatial_merge_size) ** 2, max_pixels=max_pixels)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]
    out = proc(images=images, return_tensors="pt")

    def text(n: int) -> list[int]:
        ids = rng.integers(1, min(vocab, 400), n).tolist()
        return [i if i not in avoid else 1 for i in ids]

    rows = []
    unit = v.spatial_merge_size ** 2
    for i, (t, h, w) in enumerate(out["image_grid_thw"].tolist()):
        rows.append(text(2 + i) + [start] + [args.image_token_id] * (t * h * w // unit) + [end] + text(5 - i % 5))
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": out["pixel_values"].float(),
            "image_grid_thw": out["image_grid_thw"]}


@torch.no_grad()
def vlm_mcore_forward(model_chunks: list[nn.Module], parallel_state, batch: dict[str, torch.Tensor],
                      vocab_size: Optional[int] = None) -> torch.Tensor:
    """The batch through megatron VLM chunks (one micro-batch, any TP/PP); collective over the world.

    Returns on every rank logits [B, T, vocab_size] (TP shards gathered, padded columns cut) or values [B, T].
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ps = parallel_state
    device = next(model_chunks[0].parameters()).device
    b, t = batch["input_ids"].shape
    data = {k: v.to(device) for k, v in batch.items()}
    for chunk in model_chunks:
        chunk.eval()

    def forward_step(data_iterator, model):
        d = next(data_iterator)
        out = model(d["input_ids"], None, None, d["pixel_values"], d["image_grid_thw"], token_mask=d["attention_mask"])
        return out, lambda output, non_loss_data=True: output

    fb = get_forward_backward_func()
    outs = fb(forward_step_func=forward_step, data_iterator=iter([data]), model=model_chunks[0], num_microbatches=1,
              seq_length=t, micro_batch_size=b, forward_only=True, collect_non_loss_data=True)
    is_value = getattr(model_chunks[-1], "megappo_role", "actor") in ("critic", "reward")
    out = outs[0].float() if ps.is_pipeline_last_stage else None
    return last_stage_output(out, ps, is_value, vocab_size, device)


@torch.no_grad()
def hf_vlm_forward(hf_dir: str, batch: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """transformers' Qwen2(.5)-VL logits [B, T, V] for the batch (local files only)."""
    import transformers

    from megappo.convert.hf_io import read_json_object

    family = read_json_object(os.path.join(hf_dir, "config.json"), "config.json")["model_type"]
    cls = {"qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
           "qwen2_vl": transformers.Qwen2VLForConditionalGeneration}[family]
    model = cls.from_pretrained(hf_dir, dtype=dtype, local_files_only=True).eval()
    image_token = model.config.image_token_id
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                pixel_values=batch["pixel_values"].to(dtype), image_grid_thw=batch["image_grid_thw"],
                # mm_token_type_ids lets transformers compute the multimodal rotary positions (text 0, image 1)
                mm_token_type_ids=(batch["input_ids"] == image_token).int())
    return out.logits.float()


def verify_vlm(hf_dir: str, chunks: list[nn.Module], ps, mcfg: dict, *, atol: float, dtype: torch.dtype,
               seed: int = 0, **_text_only: Any) -> dict[str, Any]:
    """Compare loaded megatron `chunks` with `hf_dir` on an image batch; collective. {max_abs_diff, atol, ok, ...}
    (`_text_only`: a text model's batch, seq_len and trust_remote_code; the image batch has its own sizes)"""
    role = getattr(chunks[0], "megappo_role", "actor")
    if role != "actor" and role != "ref":
        raise NotImplementedError(f"verify of a {role} VLM: only causal-LM checkpoints are compared")
    batch = image_batch(mcfg, seed=seed)
    vocab = int(read_vlm_config(mcfg).text_config["vocab_size"])
    ours = vlm_mcore_forward(chunks, ps, batch, vocab_size=vocab)
    mask = batch["attention_mask"].bool()
    diff = torch.zeros(1, device=next(chunks[0].parameters()).device)
    if ps.rank == 0:
        theirs = hf_vlm_forward(hf_dir, batch, dtype)
        diff = (theirs - ours)[mask].abs().max().reshape(1).to(diff.device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(diff, src=0)
    return dict(atol=atol, shape=tuple(ours.shape), role=role, images=batch["image_grid_thw"].tolist(),
                max_abs_diff=float(diff.item()), ok=bool(diff.item() <= atol))
