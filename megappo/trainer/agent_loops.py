"""The kinds of agent loop a run's episodes can use besides an environment class: the tool loop
(`megappo.multi_turn`) and agent programs (`megappo.agents`). The episode loop (`megappo.envs.registry`) runs them
without importing them, and the two plug-ins never import each other."""
from __future__ import annotations

from typing import Any

from megappo.envs.registry import LoopKinds


def _tool_loop(settings: Any, tokenizer) -> Any:
    from megappo.multi_turn.env import tool_loop

    return tool_loop(settings, tokenizer)


def _program_loop(*args: Any, **kwargs: Any) -> Any:
    from megappo.agents.program import AgentProgramLoop

    return AgentProgramLoop(*args, **kwargs)


def loop_kinds() -> LoopKinds:
    return LoopKinds(tool_loop=_tool_loop, program_loop=_program_loop)
