"""`megappo rollout-server --engine vllm` in a process of its own and a trainer on its URL and key, as users run them
on server nodes: the trainer trains step after step (the health check between steps sends the key vLLM's /health
asks for), the server's log sits in the run's folder, its leftovers in the temporary folder go with it, and once
the server died the trainer's error quotes the last lines of its log."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from megappo.config import load_config
from megappo.testing.prompts import read_metrics, tiny_run_overrides, write_prompt_parquet
from megappo.trainer import fit

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]
R = "actor_rollout_ref.rollout"


def _start_rollout_server(vllm_python: str, model_dir: str, run: Path, tmp: Path) -> tuple[subprocess.Popen, dict]:
    """The command users run, in its own process group, its temporary folder `tmp`; its published record."""
    url_file = run / "servers" / "server.json"
    key_file = run.parent / "api_key"
    key_file.write_text("k" * 32 + "\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "megappo.cli", "rollout-server", "--engine", "vllm", "--model", model_dir,
         "--url-file", str(url_file), "--api-key-file", str(key_file), "--host", "127.0.0.1",
         "--python", vllm_python, "--", "--max-num-seqs", "8", "--max-model-len", "512", "--seed", "0"],
        env={**os.environ, "TMPDIR": str(tmp)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    deadline = time.monotonic() + 300
    while not url_file.exists():
        assert proc.poll() is None, f"rollout-server exited with {proc.returncode}:\n{proc.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, "rollout-server published no URL in 300 s"
        time.sleep(0.5)
    return proc, json.loads(url_file.read_text())


def _kill_the_engine(server: subprocess.Popen) -> None:
    """SIGKILL the vLLM server's process group (not rollout-server's), as a crash or the OOM killer would."""
    import psutil

    engine = [p for p in psutil.Process(server.pid).children(recursive=True)
              if "vllm/launch.py" in " ".join(p.cmdline()) and "reaper.py" not in " ".join(p.cmdline())]
    os.killpg(engine[0].pid, signal.SIGKILL)


def test_a_trainer_on_a_rollout_server_of_its_own_trains_and_quotes_its_log_when_it_dies(vllm_python, vllm_models,
                                                                                          tmp_path):
    # a temporary folder of its own, short: vLLM's engine sockets live there (a unix socket path has 107 bytes)
    tmp = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))
    try:
        _train_until_the_server_dies(vllm_python, vllm_models[0], tmp_path, tmp)
        assert os.listdir(tmp) == []  # vLLM's vllm_dist_<uuid> file went with the server's own temporary folder
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _train_until_the_server_dies(vllm_python: str, model_dir: str, tmp_path: Path, tmp: Path) -> None:
    run = tmp_path / "run"
    train = write_prompt_parquet(str(tmp_path / "train.parquet"), 16)
    server, record = _start_rollout_server(vllm_python, model_dir, run, tmp)

    def config(steps: int):
        return load_config("gsm8k/tiny_cpu", tiny_run_overrides(
            str(run), model_dir, train, steps=steps,
            extra=[f"{R}.name=vllm", f"{R}.server_urls=[{record['url']}]",
                   f"{R}.api_key_file={tmp_path / 'api_key'}", f"{R}.n=2"]))

    try:
        assert fit(config(2)) == 0
        rows = read_metrics(str(run))
        _kill_the_engine(server)
        assert server.wait(timeout=60) == 1  # rollout-server saw its server die, and says so
        assert "exited on its own" in server.stdout.read()
        with pytest.raises(RuntimeError) as error:  # the run goes on, on the dead server
            fit(config(3))
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    # two steps trained on the server, each with the weights of the update before (keyed health checks kept it)
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["rollout/weight_version"] for r in rows] == [1, 2]
    assert all(r["rollout/servers_live"] == 1 and r["rollout/logprob_diff_mean"] <= 1e-3 for r in rows)
    log = Path(record["log"])
    assert log.parent == run / "servers" and log.name.startswith("vllm_server_127.0.0.1_")
    assert "megappo-reaper: server exited with code -9" in log.read_text()
    message = str(error.value)
    assert "samples got no answer" in message and f"the last 20 lines of its log {log}" in message
    assert "megappo-reaper: server exited with code -9" in message  # the cause, quoted from the log
