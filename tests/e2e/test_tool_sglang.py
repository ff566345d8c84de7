"""Multi-turn tool calling on a real CPU SGLang server: the tool recipe (recipes/cpu/tiny_tool_ppo.yaml) with
rollout.name=sglang in one_step_off mode (generation beside training). The server generates every turn from token
ids and stops at `</tool_call>` (stop_token_ids, the stop token kept); the trajectories match the chat template and
the warm-started model's calls are answered."""
from __future__ import annotations

import pytest

from megappo.config import load_config
from megappo.testing.prompts import read_metrics
from megappo.trainer import fit

pytestmark = [pytest.mark.e2e, pytest.mark.sglang, pytest.mark.long]  # ~2 minutes (the warm start ~1 of them)


def test_tool_recipe_on_sglang_one_step_off(sglang_python, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = load_config("cpu/tiny_tool_ppo", [
        f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.logger=[]", "trainer.total_training_steps=4",
        "trainer.val_before_train=false", "async_training.mode=one_step_off", "actor_rollout_ref.hybrid_engine=false",
        # the plumbing, not the learning: small steps keep one_step_off's stale batches under the KL guard
        "actor_rollout_ref.actor.optim.lr=1e-4", "critic.optim.lr=1e-4", "actor_rollout_ref.rollout.verify_sync=true",
        "actor_rollout_ref.rollout.name=sglang", f"actor_rollout_ref.rollout.server_python={sglang_python}"])
    cfg.actor_rollout_ref.rollout.engine_kwargs = {}
    assert fit(cfg) == 0
    steps = [r for r in read_metrics(str(tmp_path / "run")) if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["tool/calls_per_sample"] > 0 and r["multi_turn/turns_max"] >= 2 for r in steps), steps
    assert max(r["multi_turn/template_mismatch_fraction"] for r in steps) <= 0.15
    assert max(r["tool/error_fraction"] for r in steps) <= 0.5
    assert steps[-1]["async/staleness_max"] == 1.0
