"""The preflight's agent checks (`actor_rollout_ref.rollout.agent`): the agent config YAML reads as the run reads it
(`megappo.envs.registry.read_agent_config`: names, keys, shapes), `default_agent_loop` names an agent the run has, and,
with the files, every entry's code is loaded as the run loads it (an environment's class; an agent program's function
through `megappo.agents.runner.resolve_agent`, whose checks then run here too). A missing package (`openai` for an
agent program written against it) or a misspelt name is found before the warm start and the model load, not at the
first episode.

Light to import: megappo.envs and the user's code are imported only when the run has agents.
"""
from __future__ import annotations

import difflib
import os
from typing import Any

from megappo.config import MegappoConfig

_P = "actor_rollout_ref.rollout.agent"


def check_agents(cfg: MegappoConfig, errors: list[str], check_files: bool) -> None:
    """Append each problem of the run's agents to `errors` (nothing when the run has none)."""
    agent = cfg.actor_rollout_ref.rollout.agent
    path = agent.agent_loop_config_path
    if not (path or agent.default_agent_loop):
        return
    from megappo.envs.registry import AgentConfigError, read_agent_config

    entries: list[dict] = []
    if path:
        if not os.path.isfile(os.path.expanduser(path)):
            return  # validate names a missing file when the files are checked; a recipe may be checked without it
        try:
            entries = read_agent_config(path)
        except AgentConfigError as e:
            errors.append(f"{_P}.agent_loop_config_path: {e}")
            return
    _check_default(cfg, [e["name"] for e in entries], errors)
    if check_files:
        base = os.path.dirname(os.path.abspath(os.path.expanduser(path))) if path else ""
        for entry in entries:
            problem = _load_problem(entry, base)
            if problem:
                errors.append(f"{_P}.agent_loop_config_path: {path}, agent {entry['name']}: {problem}")


def _check_default(cfg: MegappoConfig, configured: list[str], errors: list[str]) -> None:
    """default_agent_loop is the tool loop (with multi_turn on), a built-in environment or an entry of the YAML."""
    from megappo.envs.registry import BUILTIN

    r = cfg.actor_rollout_ref.rollout
    default = r.agent.default_agent_loop
    tool_loop = bool(r.multi_turn.enable and r.multi_turn.tool_config_path)
    names = sorted({*BUILTIN, *configured, *(["tool_agent"] if tool_loop else [])})
    if not default or default in names:
        return
    key = f"{_P}.default_agent_loop"
    if default == "tool_agent":
        errors.append(f"{key}: tool_agent is the multi-turn tool loop, which is off; set "
                      "actor_rollout_ref.rollout.multi_turn.enable=true with its tool_config_path, or name another "
                      f"agent ({', '.join(names)})")
        return
    near = difflib.get_close_matches(default, names, n=1)
    where = (f"in {r.agent.agent_loop_config_path}" if r.agent.agent_loop_config_path
             else f"(no {_P}.agent_loop_config_path is set)")
    errors.append(f"{key}: {default!r} is not an agent of this run: not built in ({', '.join(sorted(BUILTIN))}) "
                  f"nor {where}" + (f"; did you mean {near[0]!r}?" if near else "") +
                  f"; add it to {_P}.agent_loop_config_path (- name: {default}, environment: path/to/env.py:Class) "
                  "or name one of " + ", ".join(names))


def _load_problem(entry: dict, base: str) -> Any:
    """Why the entry's code does not load as the run loads it (None when it does): its file or module imports, the
    name is there, an environment is a class (or factory) and an agent program passes `resolve_agent`'s checks."""
    from megappo.platform.user_code import load_named

    try:
        if entry.get("environment"):
            factory = load_named(entry["environment"], base, "environment")
            if not callable(factory):
                return (f"environment: {entry['environment']!r} is a {type(factory).__name__}, not a class; name "
                        "the Environment class (or a function that makes one)")
            return None
        from megappo.agents.runner import resolve_agent

        module, _, function = entry["agent"].rpartition(":")
        spec = entry["agent"]
        if module.endswith(".py") and not os.path.isabs(module):  # as the run reads it: from the YAML's folder
            spec = f"{os.path.join(base, module)}:{function}"
        resolve_agent(spec)
    except ValueError as e:  # UserCodeError and its kinds: the message names what and the fix
        return str(e)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's code failed in a way of its own
        return f"loading it raised {type(e).__name__}: {e}"
    return None
