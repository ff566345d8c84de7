"""Every bundled recipe whose KL guard is on can roll back from its first step.

A rollback restores the run's last checkpoint (build.rollback). Before step 1 is saved the only one is step 0's,
which the trainer writes only when the guard is on and trainer.save_freq > 0 (loop.fit); and the guard refuses to
roll back at all when save_freq <= 0 (build.setup: KLGuard(can_roll_back=save_freq > 0)). A recipe with the guard
on and no checkpoints stops with exit 3 at its first KL spike instead of rolling back and retrying it."""
from __future__ import annotations

import pytest

from megappo.config import load_config
from megappo.config.loader import bundled_recipes

RECIPES = bundled_recipes()


def test_every_recipe_is_checked():
    assert {"cpu/tiny_ppo", "cpu/tiny_tool_ppo", "gsm8k/tiny_cpu", "dapo/qwen2.5-7b_dapo"} <= set(RECIPES)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_recipes_guard_can_roll_back_from_step_1(name):
    t = load_config(str(RECIPES[name])).trainer
    assert not t.guard.enable or t.save_freq > 0, (
        f"recipes/{name}.yaml: the KL guard is on (trainer.guard.enable) but trainer.save_freq={t.save_freq} "
        "saves no checkpoint, so a KL spike stops the run instead of rolling it back: set trainer.save_freq > 0 "
        "(the guard then also saves step 0)")
