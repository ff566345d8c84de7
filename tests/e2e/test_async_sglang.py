"""The asynchronous schedules on a real CPU SGLang server the trainer starts: the main job's recipes with
rollout.name=sglang. one_step_off generates the next batch while the trainer trains and trains it one version
behind; fully_async (syncs every 2 steps, half a window ahead, no partial rollouts: SGLang's aborted requests are
not continued yet) keeps its staleness within the bound; both learn like the synchronous main job within its 20
steps, and the server is stopped at the end."""
from __future__ import annotations

import subprocess

import pytest

from megappo.config import load_config
from megappo.testing.prompts import read_metrics
from megappo.trainer import fit

pytestmark = [pytest.mark.e2e, pytest.mark.sglang]


def _servers(run_dir) -> list[str]:
    """The SGLang servers serving a model of `run_dir` (the synthetic task's model is written there)."""
    ps = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if "sglang.launch_server" in line and str(run_dir) in line]


def _learned(rows: list[dict]) -> float:
    rewards = [r["reward/mean"] for r in rows if r["step"] > 0]
    return sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5


# one_step_off's schedule is fully_async's with W = 1 and threshold 1 (tests/e2e/test_fully_async.py): the long tier
@pytest.mark.parametrize("recipe", [pytest.param("tiny_ppo_one_step_off", marks=pytest.mark.long), "tiny_ppo_async"])
def test_async_recipes_on_sglang_learn(sglang_python, tmp_path, monkeypatch, recipe):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    extra = ["async_training.partial_rollout=false"] if recipe == "tiny_ppo_async" else []
    cfg = load_config(f"cpu/{recipe}", [
        f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.logger=[]", "trainer.save_freq=-1",
        "actor_rollout_ref.rollout.name=sglang", f"actor_rollout_ref.rollout.server_python={sglang_python}", *extra])
    cfg.actor_rollout_ref.rollout.engine_kwargs = {}  # the recipes' threads are the in-process engine's
    assert fit(cfg) == 0
    rows = read_metrics(str(tmp_path / "run"))
    assert [r["step"] for r in rows][-1] == 20
    steps = [r for r in rows if r["step"] > 0]
    bound = 1.0
    assert max(r["async/staleness_max"] for r in steps) == bound and steps[0]["async/staleness_max"] == 0.0
    assert _learned(rows) >= 0.3, [r["reward/mean"] for r in steps]
    assert _servers(tmp_path) == []  # the trainer stopped the server it started
