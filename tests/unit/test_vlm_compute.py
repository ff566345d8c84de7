"""The trainer's compute on vision-language rows (Qwen2.5-VL): log-probs, values and training steps with images.

A batch of prompts that each hold an image of a different size (plus a text-only row), with responses of different
lengths, left-padded / right-padded as the trainer builds it (`ModelBatch.multi_modal`: each row's images):

- `compute_log_probs` equals transformers' `Qwen2_5_VLForConditionalGeneration` run on each sequence alone (1e-4,
  float32), in micro-batches of 2 (images must travel with their rows) and packed (THD: mrope positions restart
  per sequence);
- packed equals padded for the critic's values and for a `train_step` of the actor (loss, grad norm, every
  gradient), the vision tower trained (unfrozen) so that its gradients are compared too;
- other (blank) images give other log-probs: the pixels reach the language model.

World 1 (TP1); the TP2 x PP2 run is in tests/multirank/test_vlm_compute_layouts.py.
"""
from __future__ import annotations

from megappo.testing.vlm_compute import check_vlm_compute, run_vlm_compute


def test_vlm_compute_matches_transformers_tp1(tmp_path):
    from megappo.testing.vlm_models import make_hf_vlm

    hf_dir = make_hf_vlm(str(tmp_path / "vlm"))
    (res,) = run_vlm_compute(hf_dir, 1, {})
    check_vlm_compute(hf_dir, res)
