"""The tool interface and the tool config file (verl 0.9.1's shape).

`actor_rollout_ref.rollout.multi_turn.tool_config_path` names a YAML file:

    tools:
      - class_name: megappo.multi_turn.python_tool.PythonTool   # or path/to/file.py:ClassName
        config: {timeout_s: 5}                                  # the tool's own settings
        tool_schema:                                            # an OpenAI function, given to the chat template
          type: function
          function: {name: python, description: ..., parameters: {type: object, properties: {...}, required: [...]}}

A tool is a small class: `create` starts one trajectory's instance (state a tool keeps across the calls of one
conversation), `execute` answers a call, `release` ends the instance. Calls may come from several threads at once
(different instances); a tool that keeps shared state guards it itself.

A relative tool_config_path in a recipe is read from the recipe's folder (megappo.config.loader.recipe_relative),
and a relative file class_name from the tool config's folder, so a run works from any working directory.
`check_tools` checks a configuration's tools without building them (the dry run and the preflight call it).
"""
from __future__ import annotations

import difflib
import importlib
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from megappo.platform.user_code import UserCodeError, import_file


@dataclass
class ToolResult:
    text: str  # what the model reads as the tool's answer
    reward: float = 0.0  # added to the trajectory's step reward (most tools: 0)
    metrics: dict[str, float] = field(default_factory=dict)  # logged as tool/<name>/<key> (means over calls)


class BaseTool:
    """One tool. `config` is the YAML entry's `config`, `tool_schema` its OpenAI function schema."""

    def __init__(self, config: dict, tool_schema: dict):
        self.config = dict(config or {})
        self.tool_schema = tool_schema
        self.name: str = tool_schema["function"]["name"]

    def create(self, instance_id: str, **kwargs: Any) -> None:
        """Start the instance of one trajectory (kwargs: the prompt's `tools_kwargs` for this tool, if any)."""

    def execute(self, instance_id: str, arguments: dict) -> ToolResult:
        """Answer one call with its parsed JSON arguments. Errors the model made (bad arguments) are answers that say
        what was wrong, not exceptions."""
        raise NotImplementedError

    def release(self, instance_id: str) -> None:
        """End the instance: free what it holds."""


class ToolConfigError(UserCodeError):
    """A tool config that cannot run: the message names the file, the entry and the fix."""


def _import_class(class_name: str, base_dir: Optional[str], where: str) -> type:
    """`package.module.Class`, or `path/to/file.py:Class` with the path relative to `base_dir` (the tool config's
    folder)."""
    from megappo.config.loader import recipe_relative

    if ":" in class_name and class_name.split(":")[0].endswith(".py"):
        file, name = class_name.rsplit(":", 1)
        path = os.path.abspath(recipe_relative(file, base_dir))
        if not os.path.isfile(path):
            raise ToolConfigError(f"{where}: class_name {class_name!r}: no file {path}; a relative path is read "
                                  "from the tool config's folder")
        try:
            module = import_file(path, "megappo_user_tool")
        except Exception as e:
            raise ToolConfigError(f"{where}: class_name {class_name!r}: importing {path} failed: "
                                  f"{type(e).__name__}: {e}") from e
    else:
        module_name, _, name = class_name.rpartition(".")
        if not module_name:
            raise ToolConfigError(f"{where}: class_name {class_name!r}: write it as package.module.Class or "
                                  "path/to/file.py:Class")
        try:
            module = importlib.import_module(module_name)
        except Exception as e:
            raise ToolConfigError(f"{where}: class_name {class_name!r}: cannot import {module_name} "
                                  f"({type(e).__name__}: {e})") from e
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        defined = [k for k, v in vars(module).items() if isinstance(v, type) and v.__module__ == module.__name__]
        close = difflib.get_close_matches(name, defined, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f" (it defines: {', '.join(defined) or 'no classes'})"
        raise ToolConfigError(f"{where}: class_name {class_name!r}: {name} is not a class there{hint}")
    if getattr(cls, "execute", BaseTool.execute) is BaseTool.execute:
        raise ToolConfigError(f"{where}: class_name {class_name!r}: {name} does not define execute(instance_id, "
                              "arguments), so it cannot answer a call")
    return cls


def _check_schema(schema: Any, where: str) -> None:
    """An OpenAI function schema, as chat templates read it."""
    shape = ("; write {type: function, function: {name, description, parameters: {type: object, properties: "
             "{...}, required: [...]}}}")
    if not isinstance(schema, dict) or schema.get("type") != "function" or not isinstance(schema.get("function"),
                                                                                         dict):
        raise ToolConfigError(f"{where}.tool_schema is not an OpenAI function{shape}")
    fn = schema["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
        raise ToolConfigError(f"{where}.tool_schema.function.name {name!r}: the model calls a tool by this name; "
                              "use letters, digits, _ . - (at most 64)")
    if not isinstance(fn.get("description", ""), str):
        raise ToolConfigError(f"{where}.tool_schema.function.description must be a string")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type") != "object" or \
            not isinstance(params.get("properties", {}), dict):
        raise ToolConfigError(f"{where}.tool_schema.function.parameters must be {{type: object, properties: "
                              "{...}}} (a call's arguments are a JSON object)")
    required = params.get("required", [])
    missing = [r for r in required if r not in params.get("properties", {})] if isinstance(required, list) else None
    if missing is None or missing:
        raise ToolConfigError(f"{where}.tool_schema.function.parameters.required must list names of its "
                              f"properties (not in properties: {missing})")


def read_tool_config(path: str) -> list[tuple[type, dict, dict]]:
    """(class, config, schema) of each tool of a tool config file, classes imported and schemas checked; no tool
    is built."""
    import yaml

    path = os.path.expanduser(path)
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        raise ToolConfigError(f"tool config {path}: cannot read it ({e.strerror})") from e
    except yaml.YAMLError as e:
        raise ToolConfigError(f"tool config {path}: not valid YAML: {e}") from e
    entries = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ToolConfigError(f"{path}: expected a top-level `tools:` list (verl's tool config shape)")
    out, names = [], set()
    for k, entry in enumerate(entries):
        where = f"{path}: tools[{k}]"
        if not isinstance(entry, dict) or "class_name" not in entry or "tool_schema" not in entry:
            raise ToolConfigError(f"{where} needs class_name and tool_schema (and optionally config)")
        if not isinstance(entry.get("config") or {}, dict):
            raise ToolConfigError(f"{where}.config must be a mapping of the tool's settings")
        _check_schema(entry["tool_schema"], where)
        name = entry["tool_schema"]["function"]["name"]
        if name in names:
            raise ToolConfigError(f"{path}: two tools are named {name!r}")
        names.add(name)
        cls = _import_class(str(entry["class_name"]), os.path.dirname(os.path.abspath(path)), where)
        out.append((cls, entry.get("config") or {}, entry["tool_schema"]))
    return out


def check_tools(mt_cfg: Any, base_dir: Optional[str] = None) -> None:
    """Raise ToolConfigError unless every tool of `actor_rollout_ref.rollout.multi_turn` (`mt_cfg`) can be loaded:
    the tool config file is read (a relative tool_config_path from `base_dir`, the folder of the YAML that names
    it; None: the working directory), every class imported and every schema checked. No tool is built and no
    worker started (the dry run and the preflight call it). Nothing to check when multi-turn is off."""
    if not getattr(mt_cfg, "enable", False):
        return
    path = getattr(mt_cfg, "tool_config_path", None)
    if not path:
        raise ToolConfigError("actor_rollout_ref.rollout.multi_turn.tool_config_path is not set but "
                              "multi_turn.enable is; name a tool config YAML (verl's shape)")
    from megappo.config.loader import recipe_relative

    read_tool_config(recipe_relative(path, base_dir))


def tool_schemas(path: Optional[str]) -> Optional[list[dict]]:
    """The schemas a tool config gives the chat template as `tools=` (None without tools); no tool is built."""
    if not path:
        return None
    return [schema for _, _, schema in read_tool_config(path)] or None


def load_tools(path: Optional[str]) -> dict[str, BaseTool]:
    """The tools of a tool config file, by their schema's function name ({} for None)."""
    if not path:
        return {}
    tools: dict[str, BaseTool] = {}
    for cls, config, schema in read_tool_config(path):
        tool = cls(config, schema)
        tools[tool.name] = tool
    return tools
