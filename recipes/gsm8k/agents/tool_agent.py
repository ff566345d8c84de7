"""An agent program that solves GSM8K with tools on the `openai` client (recipes/gsm8k/qwen3-8b_agent_tools.yaml):
it offers the model the tools of a tool config in verl's shape (recipes/tools/python_tool.yaml: megappo's sandboxed
Python; recipes/cpu/tools/calculator.yaml: the calculator), runs each tool call the endpoint returns itself, sends
the answers back as "tool" messages until the model answers without a call, and scores that answer with the GSM8K
rule (the number after "####").

The tools are built once per process from their config and shared by the episodes (their `execute` is called from
many threads, as the built-in tool loop calls them). Returns {"reward": ..., "metrics": {...}}: the metrics show as
env/tool_calls, env/tool_errors and env/turns."""
from __future__ import annotations

import json
import os
import threading
import uuid

import openai

from megappo.multi_turn.tools import BaseTool, load_tools
from megappo.rewards.gsm8k import compute_score

_TOOLS: dict[str, dict[str, BaseTool]] = {}
_LOCK = threading.Lock()


def tools_of(config: str) -> dict[str, BaseTool]:
    """The tools of `config` (relative: from this file's folder), built at the first episode."""
    path = config if os.path.isabs(config) else os.path.join(os.path.dirname(os.path.abspath(__file__)), config)
    with _LOCK:
        if path not in _TOOLS:
            _TOOLS[path] = load_tools(path)
        return _TOOLS[path]


def run_call(tools: dict[str, BaseTool], call, episode: str) -> tuple[str, bool]:
    """A tool call's answer and whether it failed: the model's arguments are untrusted, a bad one is an answer that
    says so (the model reads it), not an exception that ends the episode."""
    tool = tools.get(call.function.name)
    if tool is None:
        return f"Error: no tool named {call.function.name!r}; the tools are {', '.join(sorted(tools))}.", True
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except ValueError as e:
        return f"Error: the arguments are not JSON ({e}).", True
    result = tool.execute(episode, arguments)
    return result.text, bool(result.metrics.get("error", 0.0))


def solve(base_url: str, api_key: str, row, tool_config: str = "../../tools/python_tool.yaml", max_turns: int = 5,
          max_tokens: int = 1024) -> dict:
    """One episode: at most `max_turns` model calls; the final answer is scored against the row's ground truth."""
    tools = tools_of(tool_config)
    schemas = [t.tool_schema for t in tools.values()]
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)
    messages, answer = list(row.prompt), ""
    calls = errors = turns = 0
    episode = uuid.uuid4().hex
    for tool in tools.values():
        tool.create(episode, **row.tools_kwargs.get(tool.name, {}).get("create_kwargs", {}))
    try:
        for turns in range(1, max_turns + 1):
            reply = client.chat.completions.create(model="policy", messages=messages, tools=schemas,
                                                   max_tokens=max_tokens)
            message = reply.choices[0].message
            if not message.tool_calls or reply.choices[0].finish_reason == "length":
                answer = message.content or ""
                break
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                text, failed = run_call(tools, call, episode)
                calls, errors = calls + 1, errors + failed
                messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
    finally:
        for tool in tools.values():
            tool.release(episode)
        client.close()
    return {"reward": compute_score(answer, row.ground_truth),
            "metrics": {"tool_calls": float(calls), "tool_errors": float(errors), "turns": float(turns)}}
