"""A 2-step PPO run whose rollout is a real SGLang server on CPU, started and stopped by the trainer: the server
generates, takes the actor's weights after each update over a gloo group, and its log-probs match the trainer's."""
from __future__ import annotations

import subprocess

import pytest

from megappo.config import load_config
from megappo.testing.prompts import read_metrics, tiny_run_overrides, write_prompt_parquet
from megappo.trainer import fit

pytestmark = [pytest.mark.e2e, pytest.mark.sglang]


def _servers(model_dir: str, kinds: tuple[str, ...] = ("sglang.launch_server",)) -> list[str]:
    """The SGLang processes serving `model_dir` (this session's model: another session's servers on the same
    machine are not this test's business)."""
    ps = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if any(k in line for k in kinds) and model_dir in line]


# at trainer level the default (distributed) runs in the DP2 and router tests below; both modes at fleet level
@pytest.mark.parametrize("sync", ["disk", pytest.param("distributed", marks=pytest.mark.long)])
def test_two_steps_with_an_sglang_rollout(sglang_python, hf_model_dir, tmp_path, sync):
    """Each sync mode: the server then holds exactly the actor's weights (verify_sync compares its log-probs of
    fixed tokens with the trainer's after every sync) and reports the new version."""
    train = write_prompt_parquet(str(tmp_path / "train.parquet"), 16)
    before = _servers(hf_model_dir("qwen2"))
    cfg = load_config("gsm8k/tiny_cpu", tiny_run_overrides(
        str(tmp_path / "run"), hf_model_dir("qwen2"), train, steps=2,
        extra=["actor_rollout_ref.rollout.name=sglang", f"actor_rollout_ref.rollout.server_python={sglang_python}",
               f"actor_rollout_ref.rollout.weight_sync={sync}", "actor_rollout_ref.rollout.verify_sync=true"]))
    assert fit(cfg) == 0
    rows = read_metrics(str(tmp_path / "run"))
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        # the server sampled at temperature 1 from the weights the trainer had: same log-probs up to float error
        assert r["rollout/logprob_diff_mean"] <= 1e-3
        assert r["rollout/weight_sync_bytes"] > 0 and r["rollout/verify_sync_max_diff"] <= 1e-3
    assert rows[1]["rollout/weight_version"] == 2
    assert _servers(hf_model_dir("qwen2")) == before  # the trainer stopped the server it started


@pytest.mark.multirank
@pytest.mark.long  # started servers under the trainer: the router test; torchrun layouts: tests/cluster, test_two_nodes
def test_two_data_parallel_ranks_share_the_started_server(sglang_python, hf_model_dir, tmp_path):
    """DP2 under torchrun: rank 0 starts the server (with a random API key), both ranks' engines send their halves
    of the batch to it with that key, and rank 0 streams the weights."""
    import os
    import signal
    import sys

    from megappo.testing.dist import free_port

    train = write_prompt_parquet(str(tmp_path / "train.parquet"), 16)
    out = tmp_path / "dp2"
    overrides = tiny_run_overrides(
        str(out), hf_model_dir("qwen2"), train, steps=2,
        extra=["trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.name=sglang",
               "actor_rollout_ref.actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4",
               f"actor_rollout_ref.rollout.server_python={sglang_python}", "actor_rollout_ref.rollout.verify_sync=true"])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
           "-m", "megappo.cli", "train", "--config", "gsm8k/tiny_cpu", *overrides]
    before = _servers(hf_model_dir("qwen2"))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=420)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, log[-6000:]
    rows = read_metrics(str(out))
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollout/logprob_diff_mean"] <= 1e-3 and r["rollout/verify_sync_max_diff"] <= 1e-3 for r in rows)
    assert _servers(hf_model_dir("qwen2")) == before


def _rollout_processes(model_dir: str) -> list[str]:
    """The SGLang servers of `model_dir`, and every sglang-router (it names no model)."""
    ps = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return _servers(model_dir) + [line for line in ps.splitlines() if "sglang_router" in line]


# ~70 s: a killed server behind the real router, its restart and weights are tests/e2e/test_sglang_fleet.py's on the
# engine side; this is the trainer's steps over it: the long tier
@pytest.mark.long
def test_two_started_servers_behind_the_router_survive_a_killed_server(sglang_python, hf_model_dir, tmp_path):
    """rollout.servers_per_node=2 behind a real sglang-router. One server is SIGKILLed after step 1: step 2 still
    gets every sample (the router sends the dead server's requests to the other), the sync of step 2 restarts it
    and gives it the current weights (verify_sync reads every server's log-probs), and step 3 uses both again."""
    import threading

    from megappo.testing.procs import kill_a_server_after_step_1

    train = write_prompt_parquet(str(tmp_path / "train.parquet"), 16)
    out = tmp_path / "run"
    cfg = load_config("gsm8k/tiny_cpu", tiny_run_overrides(
        str(out), hf_model_dir("qwen2"), train, steps=3,
        extra=["actor_rollout_ref.rollout.name=sglang", f"actor_rollout_ref.rollout.server_python={sglang_python}",
               "actor_rollout_ref.rollout.servers_per_node=2", "actor_rollout_ref.rollout.router=sglang",
               "actor_rollout_ref.rollout.health_check_interval_s=2", "actor_rollout_ref.rollout.verify_sync=true"]))
    before = _rollout_processes(hf_model_dir("qwen2"))
    killed: dict = {}
    killer = threading.Thread(target=kill_a_server_after_step_1, args=(str(out), "sglang.launch_server", killed),
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
    assert rows[2]["rollout/weight_version"] == 3
    # servers, the restarted one and the router all stopped
    assert _rollout_processes(hf_model_dir("qwen2")) == before
