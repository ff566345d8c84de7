"""The trainer's compute on vision-language rows at TP2 x PP2 (4 gloo ranks): the vision tower on the first stage
split over TP, images travelling with their rows through micro-batches of 2 and packs; log-probs equal
transformers' per sequence (1e-4, float32), packed equals padded (values, the actor's step and gradients).
The same checks as tests/unit/test_vlm_compute.py (TP1)."""
from __future__ import annotations

import pytest

from megappo.testing.vlm_compute import check_vlm_compute, run_vlm_compute

pytestmark = [pytest.mark.multirank, pytest.mark.long]


def test_vlm_compute_matches_transformers_tp2_pp2(tmp_path):
    from megappo.testing.vlm_models import make_hf_vlm

    hf_dir = make_hf_vlm(str(tmp_path / "vlm"))
    per_rank = run_vlm_compute(hf_dir, 4, {"tp": 2, "pp": 2}, timeout=400)
    for res in per_rank:
        check_vlm_compute(hf_dir, res)
