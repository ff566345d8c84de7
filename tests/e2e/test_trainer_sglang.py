"""A 2-step PPO run whose rollout is a real SGLang server on CPU, started and stopped by the trainer: the server
generates, takes the actor's weights after each update over a gloo group, and its log-probs match the trainer's."""
from __future__ import annotations

import subprocess

import pytest

from megappo.config import load_config
from megappo.testing.prompts import read_metrics, tiny_run_overrides, write_prompt_parquet
from megappo.trainer import fit

pytestmark = [pytest.mark.e2e, pytest.mark.sglang]


def _servers() -> list[str]:
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if "sglang.launch_server" in line]


def test_two_steps_with_an_sglang_rollout(sglang_python, hf_model_dir, tmp_path):
    train = write_prompt_parquet(str(tmp_path / "train.parquet"), 16)
    before = _servers()
    cfg = load_config("gsm8k/tiny_cpu", tiny_run_overrides(
        str(tmp_path / "run"), hf_model_dir("qwen2"), train, steps=2,
        extra=["actor_rollout_ref.rollout.name=sglang", f"actor_rollout_ref.rollout.server_python={sglang_python}"]))
    assert fit(cfg) == 0
    rows = read_metrics(str(tmp_path / "run"))
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        # the server sampled at temperature 1 from the weights the trainer had: same log-probs up to float error
        assert r["rollout/logprob_diff_mean"] <= 1e-3
        assert r["rollout/weight_sync_bytes"] > 0
    assert rows[1]["rollout/weight_version"] == 2
    assert _servers() == before  # the trainer stopped the server it started
