"""Tool configs (megappo/multi_turn/tools.py): paths from the YAML's folder whatever the working directory,
`check_tools` (the dry run's and the preflight's check: classes imported, schemas checked, nothing built), and the
preflight's refusal of a chat template that never shows the model its tools."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megappo.config import load_config
from megappo.config.schema import MultiTurnConfig
from megappo.multi_turn.tools import ToolConfigError, check_tools, load_tools

REPO = Path(__file__).resolve().parents[2]
SCHEMA = """
    tool_schema:
      type: function
      function:
        name: echo
        description: says it back
        parameters: {type: object, properties: {text: {type: string}}, required: [text]}
"""
TOOL_PY = """
from megappo.multi_turn.tools import BaseTool, ToolResult

class Echo(BaseTool):
    def execute(self, instance_id, arguments):
        return ToolResult(arguments["text"])
"""


def tool_config(folder: Path, class_name: str, schema: str = SCHEMA) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tools.yaml"
    path.write_text(f"tools:\n  - class_name: {class_name}{schema}")
    return path


def mt(path) -> MultiTurnConfig:
    return MultiTurnConfig(enable=True, tool_config_path=str(path))


def test_paths_resolve_against_the_yaml_folder(tmp_path, monkeypatch):
    """A recipe names its tool config from its own folder, the tool config its tool file from its own: both load
    from any working directory. Absolute paths, and relative ones that exist only from the working directory
    (older recipes), still work."""
    recipe_dir = tmp_path / "my_recipes"
    (recipe_dir / "tools").mkdir(parents=True)
    (recipe_dir / "tools" / "echo_tool.py").write_text(TOOL_PY)
    tool_config(recipe_dir / "tools", "echo_tool.py:Echo")
    recipe = recipe_dir / "run.yaml"
    recipe.write_text("actor_rollout_ref:\n  rollout:\n    multi_turn:\n      enable: true\n"
                      "      tool_config_path: tools/tools.yaml\n")
    monkeypatch.chdir(tmp_path / "..")
    cfg = load_config(str(recipe))
    path = cfg.actor_rollout_ref.rollout.multi_turn.tool_config_path
    assert path == str(recipe_dir / "tools" / "tools.yaml")
    check_tools(cfg.actor_rollout_ref.rollout.multi_turn)
    assert load_tools(path)["echo"].execute("i", {"text": "hi"}).text == "hi"
    # the bundled recipes, from elsewhere
    for name in ("cpu/tiny_tool_ppo", "retool/qwen2.5-7b_retool"):
        section = load_config(name).actor_rollout_ref.rollout.multi_turn
        assert os.path.isabs(section.tool_config_path) and os.path.isfile(section.tool_config_path), name
        check_tools(section)
    # a command-line path means the working directory; an older repository-root path still loads from the root
    monkeypatch.chdir(recipe_dir)
    cfg = load_config(str(recipe), ["actor_rollout_ref.rollout.multi_turn.tool_config_path=tools/tools.yaml"])
    assert cfg.actor_rollout_ref.rollout.multi_turn.tool_config_path == "tools/tools.yaml"
    monkeypatch.chdir(REPO)
    old = tmp_path / "old.yaml"
    old.write_text("actor_rollout_ref:\n  rollout:\n    multi_turn:\n      enable: true\n"
                   "      tool_config_path: recipes/cpu/tools/calculator.yaml\n")
    assert load_config(str(old)).actor_rollout_ref.rollout.multi_turn.tool_config_path == \
        "recipes/cpu/tools/calculator.yaml"


@pytest.mark.parametrize("class_name, schema, expected", [
    ("megappo.multi_turn.calculator.CalculatorTol", SCHEMA, "did you mean 'CalculatorTool'?"),
    ("megappo.multi_turn.calculater.CalculatorTool", SCHEMA, "cannot import megappo.multi_turn.calculater"),
    ("missing.py:Echo", SCHEMA, "no file"),
    ("megappo.multi_turn.tools.BaseTool", SCHEMA, "does not define execute"),
    ("megappo.multi_turn.calculator.CalculatorTool", SCHEMA.replace("type: function", "type: fn"),
     "is not an OpenAI function"),
    ("megappo.multi_turn.calculator.CalculatorTool", SCHEMA.replace("required: [text]", "required: [txt]"),
     "not in properties: ['txt']"),
    ("megappo.multi_turn.calculator.CalculatorTool", SCHEMA.replace("name: echo", "name: 'two words'"),
     "the model calls a tool by this name"),
])
def test_check_tools_names_the_problem(tmp_path, class_name, schema, expected):
    path = tool_config(tmp_path, class_name, schema)
    with pytest.raises(ToolConfigError) as info:
        check_tools(mt(path))
    assert expected in str(info.value) and f"{path}: tools[0]" in str(info.value), str(info.value)


def test_check_tools_builds_nothing(tmp_path):
    """Only imports: a tool whose constructor would start workers is not constructed; relative tool_config_path
    from base_dir."""
    (tmp_path / "costly.py").write_text(TOOL_PY + "\n    def __init__(self, *a):\n        raise SystemExit('built')\n")
    tool_config(tmp_path, "costly.py:Echo")
    check_tools(MultiTurnConfig(enable=True, tool_config_path="tools.yaml"), base_dir=str(tmp_path))
    check_tools(MultiTurnConfig(enable=False, tool_config_path="nowhere.yaml"))  # off: nothing to check
    with pytest.raises(ToolConfigError, match="tool_config_path is not set"):
        check_tools(MultiTurnConfig(enable=True))


def test_a_misspelt_tool_class_stops_the_launch_at_once(tmp_path):
    """`megappo train` from another directory: the preflight imports the tool classes, before the warm start."""
    bad = tool_config(tmp_path / "cfg", "megappo.multi_turn.calculator.Calculator")
    proc = subprocess.run([sys.executable, "-m", "megappo.cli", "train", "--config",
                           str(REPO / "recipes/cpu/tiny_tool_ppo.yaml"), "--dry-run",
                           f"actor_rollout_ref.rollout.multi_turn.tool_config_path={bad}",
                           f"trainer.default_local_dir={tmp_path / 'out'}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "actor_rollout_ref.rollout.multi_turn.tool_config_path" in proc.stderr
    assert "Calculator is not a class there; did you mean 'CalculatorTool'?" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_template_that_ignores_tools_fails_the_preflight(tmp_path):
    """The tiny test tokenizer's template drops tools=: the preflight says so; the loop refuses it too."""
    from dataclasses import replace

    from megappo.config import ConfigError
    from megappo.envs.engine import build_episodes
    from megappo.multi_turn.env import tool_rollout
    from megappo.multi_turn.tools import tool_schemas
    from megappo.testing import make_tokenizer
    from megappo.testing.tokenizer import make_chat_tokenizer
    from megappo.trainer import settings
    from megappo.trainer.agent_loops import loop_kinds
    from megappo.trainer.preflight_tools import check_multi_turn_tools

    tok = make_tokenizer(str(tmp_path / "tok"))
    cfg = load_config("cpu/tiny_tool_ppo", ["data.synthetic.name=null", f"data.tokenizer={tmp_path / 'tok'}"])
    errors: list[str] = []
    check_multi_turn_tools(cfg, errors, check_files=True, synthetic=False)
    [error] = errors
    assert error.startswith("actor_rollout_ref.rollout.multi_turn.enable: the chat template") and \
        "ignores tools=" in error and "never sees the tools" in error, error
    mt_cfg = cfg.actor_rollout_ref.rollout.multi_turn
    tools = load_tools(mt_cfg.tool_config_path)
    with pytest.raises(ValueError, match="ignores tools="):
        tool_rollout(replace(settings.episodes(cfg), response_length=40), tok, tools)
    with pytest.raises(ConfigError, match="multi_turn.enable: the chat template .* ignores tools="):
        build_episodes(settings.episodes(cfg), None, loop_kinds())  # a run whose tokenizer the preflight could not read: said at setup
    good = make_chat_tokenizer("qwen2.5")
    good.save_pretrained(tmp_path / "qwen")
    errors = []
    check_multi_turn_tools(load_config("cpu/tiny_tool_ppo", ["data.synthetic.name=null",
                                                             f"data.tokenizer={tmp_path / 'qwen'}"]),
                           errors, check_files=True, synthetic=False)
    assert errors == [] and tool_schemas(mt_cfg.tool_config_path)[0]["function"]["name"] == "calculator"
