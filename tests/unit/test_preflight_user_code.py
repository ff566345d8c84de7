"""What a new user's own agents, environments, judges and servers meet at preflight (issue 44): each problem the run
would hit after a minute of warm start and model load is found before, in one message naming the key and the fix.
The agents' YAML and code, router replay on a dense model, a distillation teacher left unset on the user's data, a
judge or teacher path that is no model folder, and servers of rollout.server_urls asked with the run's key."""
from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from megappo.config import ConfigError, load_config
from megappo.envs.registry import AgentConfigError, read_agent_config
from megappo.trainer import preflight as pf

ROOT = Path(__file__).resolve().parents[2]
R = "actor_rollout_ref.rollout"
AGENTS = f"{R}.agent.agent_loop_config_path"
ENV_CODE = """
from megappo.envs.base import Environment, EnvStep


class CountEnv(Environment):
    def start(self, row):
        return row.prompt

    def step(self, assistant):
        return EnvStep(reward=1.0, done=True)
"""


def _errors(cfg, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        pf.preflight(cfg, **kwargs)
    return str(info.value)


def _agents(tmp_path, yaml_text: str, **files: str) -> Path:
    for name, code in files.items():
        (tmp_path / name).write_text(code)
    path = tmp_path / "agents.yaml"
    path.write_text(yaml_text)
    return path


def _env_run(tmp_path, *overrides: str):
    """The guess-the-number recipe (a synthetic task: no model or data files to have), its output in tmp_path."""
    return load_config("cpu/tiny_env_ppo", [f"trainer.default_local_dir={tmp_path / 'out'}", *overrides])


# ------------------------------------------------------------------------------------------------------------------
# 1. the agents YAML: its shape, its keys, and default_agent_loop
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("entry, message", [
    ("- name: count\n  environmnet: env.py:CountEnv\n", "unknown key 'environmnet'; did you mean 'environment'?"),
    ("- name: count\n  environment: env.py:CountEnv\n  kwargs: [1, 2]\n", "kwargs: [1, 2] is not a mapping"),
    ("- name: count\n  environment: env.py:CountEnv\n  step_timeout_s: soon\n",
     "step_timeout_s: 'soon' is not a number of seconds > 0"),
    ("- name: 7\n  environment: env.py:CountEnv\n", "the name 7 is not a string"),
    ("- name: count\n  environment: [env.py, CountEnv]\n", "is not a string; write it as path/to/file.py:Name"),
    ("- name: count\n  environment: env.py:CountEnv\n- name: count\n  agent: a.py:f\n", "'count' is used twice"),
    ("- name: count\n  environment: env.py:CountEnv\n  agent: a.py:f\n", "give exactly one of environment"),
    ("- name: [count\n", "not valid YAML"),
])
def test_a_malformed_agent_config_is_named_with_the_key_and_the_fix(tmp_path, entry, message):
    path = _agents(tmp_path, entry, **{"env.py": ENV_CODE})
    with pytest.raises(AgentConfigError) as info:
        read_agent_config(str(path))
    assert message in str(info.value)
    # preflight says it before any work, under the key that names the file (recipe-only checks too: no files needed)
    err = _errors(_env_run(tmp_path, f"{AGENTS}={path}"), world_size=1)
    assert f"{AGENTS}: " in err and message in err


def test_default_agent_loop_must_name_an_agent_of_the_run(tmp_path):
    err = _errors(_env_run(tmp_path, f"{R}.agent.default_agent_loop=guess_numbr"), world_size=1)
    assert f"{R}.agent.default_agent_loop: 'guess_numbr' is not an agent of this run" in err
    assert "did you mean 'guess_number'?" in err and f"add it to {AGENTS}" in err
    err = _errors(_env_run(tmp_path, f"{R}.agent.default_agent_loop=tool_agent"), world_size=1)
    assert "tool_agent is the multi-turn tool loop, which is off" in err and "multi_turn.enable=true" in err
    # an agent of the YAML, or a built-in one, is found
    path = _agents(tmp_path, "- name: count\n  environment: env.py:CountEnv\n", **{"env.py": ENV_CODE})
    pf.preflight(_env_run(tmp_path, f"{AGENTS}={path}", f"{R}.agent.default_agent_loop=count"))
    pf.preflight(_env_run(tmp_path))


# ------------------------------------------------------------------------------------------------------------------
# 2. the agents' code, loaded as the run loads it
# ------------------------------------------------------------------------------------------------------------------
def test_an_agent_program_whose_openai_is_missing_names_the_extra(tmp_path, monkeypatch):
    """The shipped agent program imports openai; without it the message names the agents extra."""
    monkeypatch.setitem(sys.modules, "openai", None)  # this python without openai: `import openai` fails
    cfg = load_config("cpu/tiny_openai_agent_ppo", [f"trainer.default_local_dir={tmp_path / 'out'}"])
    err = _errors(cfg)
    assert f"{AGENTS}: {ROOT / 'recipes/cpu/agents/guess_openai.yaml'}, agent guess_number: " in err
    assert "ModuleNotFoundError" in err and "openai" in err and 'pip install -e ".[agents]"' in err
    pf.preflight(cfg, world_size=1)  # a recipe checked without its files imports no user code
    monkeypatch.delitem(sys.modules, "openai")
    pf.preflight(cfg)  # with openai the program loads


def test_an_environment_whose_import_or_name_is_wrong_is_named(tmp_path):
    path = _agents(tmp_path, "- name: count\n  environment: env.py:CountEnvs\n"
                             "- name: other\n  environment: other.py:Other\n"
                             "- name: value\n  environment: env.py:LIMIT\n"
                             "- name: gone\n  environment: envs/gone.py:Gone\n",
                   **{"env.py": ENV_CODE + "LIMIT = 3\n", "other.py": "import megappo_absent_pkg\nOther = 1\n"})
    err = _errors(_env_run(tmp_path, f"{AGENTS}={path}"))
    assert f"{path}, agent count: environment: 'env.py:CountEnvs': no CountEnvs there; did you mean " \
           "'CountEnv'?" in err
    assert f"{path}, agent other: environment: importing {tmp_path / 'other.py'} failed: ModuleNotFoundError" in err
    assert "-m pip install megappo_absent_pkg" in err
    assert f"{path}, agent value: environment: 'env.py:LIMIT' is a int, not a class" in err
    assert f"{path}, agent gone: environment: 'envs/gone.py:Gone': no file {tmp_path / 'envs/gone.py'}" in err


def test_an_agent_program_that_raises_at_import_is_named_not_raised(tmp_path):
    path = _agents(tmp_path, "- name: prog\n  agent: prog.py:play\n",
                   **{"prog.py": "import sys\nsys.exit('no network here')\n"})
    err = _errors(_env_run(tmp_path, f"{AGENTS}={path}"))
    assert f"{path}, agent prog: loading it raised SystemExit: no network here" in err


def test_the_dry_run_cli_names_a_missing_package_of_an_environment_and_lists_the_agents(tmp_path):
    path = _agents(tmp_path, "- name: count\n  environment: env.py:CountEnv\n",
                   **{"env.py": "import megappo_absent_pkg\n" + ENV_CODE})
    cmd = [sys.executable, "-m", "megappo.cli", "train", "--config", "cpu/tiny_env_ppo", "--dry-run",
           f"{AGENTS}={path}", f"trainer.default_local_dir={tmp_path / 'out'}"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"{AGENTS}: {path}, agent count: environment: importing" in done.stderr
    assert "No module named 'megappo_absent_pkg'" in done.stderr and "pip install megappo_absent_pkg" in done.stderr
    assert "Traceback" not in done.stderr
    (tmp_path / "env.py").write_text(ENV_CODE)
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"agents: count (env.py:CountEnv) ({path})" in done.stdout and "config OK" in done.stdout


# ------------------------------------------------------------------------------------------------------------------
# 3. router replay on a dense model
# ------------------------------------------------------------------------------------------------------------------
REPLAY = "actor_rollout_ref.actor.megatron.router_replay.mode"


def test_router_replay_on_a_dense_built_in_model_is_named_before_setup():
    err = _errors(load_config("cpu/tiny_ppo", [f"{REPLAY}=R2"]), world_size=1)
    assert f"{REPLAY}: is R2 but the synthetic task digit_max's model is dense (no MoE experts)" in err
    assert f"set {REPLAY}=disabled (or data.synthetic.name=digit_max_moe" in err
    pf.preflight(load_config("cpu/tiny_moe_replay", []), world_size=1)  # the MoE task replays


def test_router_replay_on_a_dense_model_folder_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_hidden_layers": 2}))
    cfg = load_config("gsm8k/tiny_cpu", [f"actor_rollout_ref.model.path={tmp_path}", f"{REPLAY}=R2"])
    assert "the actor's model is dense (no MoE experts)" in _errors(cfg, world_size=1)
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_hidden_layers": 2,
                                                      "num_experts": 4}))
    pf.preflight(cfg, world_size=1)


# ------------------------------------------------------------------------------------------------------------------
# 4. and 5. a distillation teacher left unset on the user's data; judge and teacher paths that are no model folder
# ------------------------------------------------------------------------------------------------------------------
def test_a_teacher_left_to_the_synthetic_task_on_the_users_data_is_named():
    """tiny_distill's teacher comes with its synthetic task; on the user's own data nothing would make it (the run
    failed in setup with a TypeError)."""
    cfg = load_config("cpu/tiny_distill", ["data.synthetic.name=null"])
    err = _errors(cfg, world_size=1)
    assert "distillation.teacher_model.model_path: is not set, and data.synthetic.teacher_smoothing=0.05" in err
    assert "set distillation.teacher_model.model_path=DIR" in err
    pf.preflight(load_config("cpu/tiny_distill", []), world_size=1)  # with its task the trainer makes the teacher


def test_a_judge_or_teacher_path_without_config_json_is_named(tmp_path):
    folder = tmp_path / "not_a_model"
    folder.mkdir()
    judge = load_config("cpu/tiny_judge_ppo", ["reward_model.judge.builtin=null", f"reward_model.judge.path={folder}",
                                               f"trainer.default_local_dir={tmp_path / 'out'}"])
    err = _errors(judge)
    assert f"reward_model.judge.path: '{folder}' has no config.json (not a Hugging Face model folder)" in err
    teacher = load_config("cpu/tiny_distill", [f"distillation.teacher_model.model_path={folder}",
                                               f"trainer.default_local_dir={tmp_path / 'out'}"])
    assert f"distillation.teacher_model.model_path: {folder} has no config.json" in _errors(teacher)
    (folder / "config.json").write_text("{}")
    pf.preflight(judge)


# ------------------------------------------------------------------------------------------------------------------
# 6. servers of rollout.server_urls asked with the key the run will send
# ------------------------------------------------------------------------------------------------------------------
@pytest.fixture
def keyed_server():
    """A real HTTP server on 127.0.0.1 that answers 200 to `Authorization: Bearer right-key` and 401 otherwise."""
    seen: list = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append((self.path, self.headers.get("Authorization")))
            ok = self.headers.get("Authorization") == "Bearer right-key"
            self.send_response(200 if ok else 401)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("engine, keyed_path", [("sglang", "/model_info"), ("vllm", "/v1/models")])
def test_each_server_url_is_asked_with_the_runs_key(tmp_path, keyed_server, engine, keyed_path):
    url, seen = keyed_server
    key_file = tmp_path / "key"
    base = [f"{R}.name={engine}", f"{R}.server_urls=[{url}]", f"trainer.default_local_dir={tmp_path / 'out'}"]
    key_file.write_text("wrong-key\n")
    err = _errors(load_config("cpu/tiny_ppo", [*base, f"{R}.api_key_file={key_file}"]))
    assert f"{R}.api_key_file: the server {url} refuses the key the run would send it" in err
    assert f"set {R}.api_key_file to that server's key" in err
    assert seen[-1] == (keyed_path, "Bearer wrong-key")
    err = _errors(load_config("cpu/tiny_ppo", [*base, f"{R}.api_key=also-wrong"]))
    assert f"{R}.api_key: the server {url} refuses the key" in err
    err = _errors(load_config("cpu/tiny_ppo", base))
    assert f"{R}.server_urls: the server {url} wants an API key and the run has none" in err
    assert seen[-1] == (keyed_path, None)
    key_file.write_text("right-key\n")
    pf.preflight(load_config("cpu/tiny_ppo", [*base, f"{R}.api_key_file={key_file}"]))
    assert seen[-1] == (keyed_path, "Bearer right-key")


def test_a_server_url_that_does_not_answer_yet_is_left_to_the_runs_wait(tmp_path):
    """The run waits server_start_timeout_s for servers given by URL; preflight does not fail one that is starting."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pf.preflight(load_config("cpu/tiny_ppo", [f"{R}.name=sglang", f"{R}.server_urls=[http://127.0.0.1:{port}]",
                                              f"trainer.default_local_dir={tmp_path / 'out'}"]))
