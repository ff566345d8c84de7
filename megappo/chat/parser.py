"""Tool-call parsers of an assistant turn's text (`rollout.multi_turn.format`).

hermes (Qwen2.5, Qwen3, Hermes): each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. A call the
model got wrong (malformed JSON, no name, arguments that are not an object) is still a `ToolCall`, with `error` set:
the loop answers it with that error as the tool's message instead of running anything, so a bad call costs the
model a turn, never the step.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
# the wrapper the hermes templates put around a tool's answer (a tool's text must never close it)
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"
_HERMES = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)


@dataclass
class ToolCall:
    name: str  # "" when it could not be read
    arguments: dict  # {} when it could not be read
    raw: str  # the text between the tags
    error: Optional[str] = None  # what was wrong with the call, for the model to read


def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """(the text without its tool calls, the calls in order). An opened `<tool_call>` that is never closed is no
    call (the turn ended without one: the budget ran out mid-call)."""
    calls = [_hermes_call(m.group(1)) for m in _HERMES.finditer(text)]
    return _HERMES.sub("", text), calls


def _hermes_call(raw: str) -> ToolCall:
    try:
        obj = json.loads(raw.strip())
    except ValueError as e:
        return ToolCall("", {}, raw, f"the tool call is not valid JSON ({e.msg} at position {e.pos}); write "
                                     '{"name": ..., "arguments": {...}} between the tool_call tags')
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", {}, raw, 'the tool call needs a "name" (a string) and "arguments" (an object)')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            pass
    if not isinstance(args, dict):
        return ToolCall(obj["name"], {}, raw, f'the "arguments" of a call to {obj["name"]} must be a JSON object')
    return ToolCall(obj["name"], args, raw)


PARSERS = {"hermes": parse_hermes}
STOP_STRINGS = {"hermes": TOOL_CALL_END}  # the text that ends a call: generation stops there
# the format's markup, which a tool's answer may not contain verbatim (megappo/chat/template.py escapes it)
MARKUP = {"hermes": (TOOL_CALL_START, TOOL_CALL_END, TOOL_RESPONSE_START, TOOL_RESPONSE_END)}
