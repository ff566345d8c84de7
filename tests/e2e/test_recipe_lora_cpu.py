"""recipes/cpu/tiny_ppo_lora.yaml as a user runs it: a LoRA actor learns (+0.3 reward, each step counted once)
without tripping its KL guard; its syncs send only the adapted layers (merged) and pass verify_sync; its
checkpoints hold the adapters alone plus the base's checksum, and a different base is refused."""
from __future__ import annotations

import json

import pytest

from megappo.testing.recipes import learned, run_recipe
from megappo.trainer.metrics import read_rows

pytestmark = pytest.mark.e2e


def test_lora_recipe_learns(tmp_path):
    from megatron.core.dist_checkpointing import load_tensors_metadata

    from megappo.models.checkpoint import CheckpointError
    from megappo.models.lora import check_lora_base

    out = tmp_path / "tiny_ppo_lora"
    rows = run_recipe("recipes/cpu/tiny_ppo_lora.yaml", out)
    # no step rolled back: every step logged once, so the recipe learns at its own learning rate, not the guard's
    assert [r["step"] for r in read_rows(str(out))] == list(range(21))
    assert learned(rows) >= 0.3, [r.get("reward/mean") for r in rows]
    synced = [r for r in rows if "rollout/verify_sync_max_diff" in r]
    assert synced and max(r["rollout/verify_sync_max_diff"] for r in synced) < 1e-3
    model_bytes = sum(p.stat().st_size for p in (out / "hf" / "actor").glob("*.safetensors"))
    assert 0 < synced[-1]["rollout/weight_sync_bytes"] < 0.5 * model_bytes  # the adapted layers only
    actor = out / "checkpoints" / "global_step_20" / "actor"
    keys = list(load_tensors_metadata(str(actor)))
    assert keys and all(".lora." in k for k in keys), keys[:5]
    base = json.loads((actor / "lora_base.json").read_text())
    assert base["path"].endswith("model") and len(base["sha256"]) == 64
    check_lora_base(str(actor), base)
    with pytest.raises(CheckpointError, match="base"):
        check_lora_base(str(actor), {**base, "sha256": "0" * 64, "path": "/elsewhere"})
    with pytest.raises(CheckpointError, match="LoRA"):
        check_lora_base(str(actor), None)


@pytest.mark.long
@pytest.mark.parametrize("share", [False, True], ids=["own_base", "actor_base"])
def test_lora_critic(tmp_path, share):
    """critic.model.lora: a LoRA critic trains its adapters and its value head, over its own copy of the base or the
    actor's (share_actor_base); its checkpoint holds just those."""
    from megatron.core.dist_checkpointing import load_tensors_metadata

    out = tmp_path / "lora_critic"
    rows = run_recipe("recipes/cpu/tiny_ppo_lora.yaml", out, "critic.model.lora.rank=8", "critic.model.lora.alpha=16",
                      "critic.optim.lr=1e-2", "trainer.save_freq=20", "trainer.test_freq=-1",
                      f"critic.model.lora.share_actor_base={str(share).lower()}")
    vf = [r["critic/vf_loss"] for r in rows if "critic/vf_loss" in r]
    assert sum(vf[-5:]) < 0.7 * sum(vf[:5]), vf
    keys = [k.replace("optimizer.state.exp_avg_sq.", "").replace("optimizer.state.exp_avg.", "")
            for k in load_tensors_metadata(str(out / "checkpoints" / "global_step_20" / "critic"))]
    assert "output_layer.weight" in keys and all(".lora." in k or k == "output_layer.weight" for k in keys), keys
