"""Input errors found once the run has started (a bad Parquet row, a tool class or an agent file that does not load)
print their message alone and exit 1; the traceback goes to <default_local_dir>/error.log, and to the console with --debug."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[2]


def _prompts(path: Path, messages: list) -> Path:
    n = len(messages)
    pq.write_table(pa.table({"data_source": ["openai/gsm8k"] * n, "prompt": messages,
                             "reward_model": [{"style": "rule", "ground_truth": "2"}] * n}), path)
    return path


@pytest.fixture
def bad_row_run(tmp_path, hf_model_dir):
    good = [[{"role": "user", "content": f"{i}+1?"}] for i in range(8)]
    bad = list(good)
    bad[5] = []  # a prompt without messages: the schema is right, the row is not (found when the run loads it)
    train, val = _prompts(tmp_path / "train.parquet", bad), _prompts(tmp_path / "val.parquet", good)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "megappo.cli", "train", "--config", "gsm8k/tiny_cpu",
           f"actor_rollout_ref.model.path={hf_model_dir('qwen2')}", f"data.train_files={train}",
           f"data.val_files={val}", f"trainer.default_local_dir={out}"]
    return cmd, train, out


def _run(cmd):
    env = dict(os.environ, MEGAPPO_CPU_THREADS="1")
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_a_bad_row_prints_the_message_alone_and_the_traceback_goes_to_the_log(bad_row_run):
    cmd, train, out = bad_row_run
    proc = _run(cmd)
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if "Loading weights" not in line]
    assert len(lines) <= 5 and "Traceback" not in proc.stderr, proc.stderr
    log = out / "error.log"
    assert lines[-1] == (f"megappo train: {train}, row 5, column 'prompt': the prompt has no messages. Fix: drop the "
                         "row or give it at least one {role, content} message "
                         f"(traceback: {log}; --debug prints it)")
    assert "Traceback" in log.read_text() and "DataError" in log.read_text()

    debug = _run(cmd[:4] + ["--debug"] + cmd[4:])
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr
    assert debug.stderr.rstrip().endswith("give it at least one {role, content} message")


def test_an_agent_file_that_does_not_import_is_one_message_naming_it(tmp_path):
    """User code is input: an agent program with a syntax error stops the launch in preflight (before any warm start)
    with one message naming the config key, the file, its line and the fix, not a trainer traceback."""
    (tmp_path / "agent.py").write_text("def play(:\n    pass\n")
    (tmp_path / "agents.yaml").write_text("- name: guess_number\n  agent: agent.py:play\n")
    out = tmp_path / "out"
    proc = _run([sys.executable, "-m", "megappo.cli", "train", "--config", "cpu/tiny_openai_agent_ppo",
                 f"actor_rollout_ref.rollout.agent.agent_loop_config_path={tmp_path / 'agents.yaml'}",
                 f"trainer.default_local_dir={out}"])
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    said = [line for line in proc.stderr.splitlines() if "agent_loop_config_path" in line]
    assert len(said) == 1 and f"importing {tmp_path / 'agent.py'} failed: SyntaxError: invalid syntax " \
        "(agent.py, line 1); fix that file" in said[0], proc.stderr
    assert not (out / "synthetic").exists()  # found before the task's warm start


def test_a_judge_parser_with_the_wrong_signature_stops_the_run_before_any_warm_start(tmp_path):
    """Checked on every rank before the judge's warm start or deployment: one line naming the signature, exit 1."""
    (tmp_path / "grade.py").write_text("def grade(verdict, question):\n    return 1.0\n")
    out = tmp_path / "out"
    proc = _run([sys.executable, "-m", "megappo.cli", "train", "--config", "cpu/tiny_judge_ppo",
                 f"reward_model.judge.parser={tmp_path / 'grade.py'}:grade", f"trainer.default_local_dir={out}"])
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.rstrip().splitlines()[-1] == (
        f"megappo train: reward_model.judge.parser={tmp_path / 'grade.py'}:grade: it takes (verdict, question), but "
        "the judge calls it with one argument, the verdict's text (missing a required argument: 'question'); define "
        "it as def grade(verdict: str) -> float | None, returning a score in [0, 1] or None where it cannot read the "
        f"verdict (traceback: {out / 'error.log'}; --debug prints it)")
    assert not (out / "synthetic").exists()  # no task or judge was made


def test_every_input_error_class_is_reported_in_one_place():
    from megappo.config import ConfigError
    from megappo.data.errors import DataError
    from megappo.envs.registry import AgentConfigError
    from megappo.multi_turn.tools import ToolConfigError
    from megappo.platform.user_code import MissingUserFile, UserCodeError
    from megappo.rewards.judge.user_parser import JudgeParserError
    from megappo.rewards.registry import RewardFunctionError
    from megappo.models.checkpoint import CheckpointError
    from megappo.trainer.run_lock import DirLocked
    from megappo.trainer.user_errors import is_user_error

    for e in (ConfigError(["k: bad; fix"]), DataError("f.parquet", "bad", "fix"), CheckpointError("ckpt"),
              DirLocked("held")):
        assert is_user_error(e)
    # user code: every kind is a UserCodeError, the one entry of the CLI's set that covers them
    for cls in (UserCodeError, MissingUserFile, AgentConfigError, ToolConfigError, RewardFunctionError,
                JudgeParserError):
        assert issubclass(cls, UserCodeError) and is_user_error(cls("agent.py: fix it"))
    assert not is_user_error(ValueError("a bug")) and not is_user_error(KeyError("k"))
