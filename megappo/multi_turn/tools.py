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
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any, Optional


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


def _import_class(class_name: str) -> type:
    """`package.module.Class` or `path/to/file.py:Class`."""
    if ":" in class_name and class_name.split(":")[0].endswith(".py"):
        path, name = class_name.rsplit(":", 1)
        path = os.path.abspath(os.path.expanduser(path))
        if not os.path.isfile(path):
            raise ValueError(f"tool class_name {class_name!r}: no file {path}")
        spec = importlib.util.spec_from_file_location(f"megappo_user_tool_{abs(hash(path))}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module_name, _, name = class_name.rpartition(".")
        if not module_name:
            raise ValueError(f"tool class_name {class_name!r}: write it as package.module.Class or file.py:Class")
        module = importlib.import_module(module_name)
    cls = getattr(module, name, None)
    if cls is None:
        raise ValueError(f"tool class_name {class_name!r}: {name} is not defined there")
    return cls


def load_tools(path: Optional[str]) -> dict[str, BaseTool]:
    """The tools of a tool config file, by their schema's function name ({} for None)."""
    if not path:
        return {}
    import yaml

    with open(os.path.expanduser(path)) as f:
        data = yaml.safe_load(f) or {}
    entries = data.get("tools")
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a top-level `tools:` list (verl's tool config shape)")
    tools: dict[str, BaseTool] = {}
    for k, entry in enumerate(entries):
        if not isinstance(entry, dict) or "class_name" not in entry or "tool_schema" not in entry:
            raise ValueError(f"{path}: tools[{k}] needs class_name and tool_schema (and optionally config)")
        schema = entry["tool_schema"]
        if not isinstance(schema, dict) or "name" not in (schema.get("function") or {}):
            raise ValueError(f"{path}: tools[{k}].tool_schema must be an OpenAI function: "
                             "{type: function, function: {name, description, parameters}}")
        tool = _import_class(entry["class_name"])(entry.get("config") or {}, schema)
        if tool.name in tools:
            raise ValueError(f"{path}: two tools are named {tool.name!r}")
        tools[tool.name] = tool
    return tools
