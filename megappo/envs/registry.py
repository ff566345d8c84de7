"""The run's agent loops by name: what runs a row's episode (its `agent_name` column, else
`rollout.agent.default_agent_loop`).

An agent loop is an object with `name`, `drives_episodes` (False: an environment, whose rounds the loop runs; True: an
agent program, `run_episodes(engine, rows, params) -> completions`), `make(row) -> Environment`, `delta` (its
`ChatDelta`: the chat template with its tool schemas), `stop_ids` (tokens that end a turn besides EOS),
`step_timeout_s` (a step's deadline; None: the environment keeps its own) and `own_turn_limits` (its steps end the
episode at the turn limits themselves), and `close()`. An environment class is one through `EnvironmentLoop` (the
built-in ones: `BUILTIN`); the tool loop ("tool_agent", over `multi_turn.tool_config_path`) and agent programs are
plug-ins above this package, given as `LoopKinds` by whoever builds the run. Others come from
`rollout.agent.agent_loop_config_path`, a YAML list (verl's agent loop config's shape):

    - name: my_env
      environment: path/to/my_env.py:MyEnv      # or package.module:MyEnv; relative to the YAML's folder
      kwargs: {max_turns: 4}                     # given to MyEnv(**kwargs) for every episode
      step_timeout_s: 30
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

from megappo.chat.template import ChatDelta
from megappo.envs.base import Environment, EpisodeRow
from megappo.platform.user_code import UserCodeError
from megappo.platform.user_code import load_named as load_object

TOOL_LOOP = "tool_agent"  # the tool loop's agent name (verl's)
# the built-in environments: name -> "module:Class", imported when a run uses them
BUILTIN = {"guess_number": "megappo.envs.guess_number:GuessNumberEnv",
           "gsm8k_feedback": "megappo.envs.gsm8k_feedback:Gsm8kFeedback"}


@dataclass(frozen=True)
class LoopKinds:
    """What a run's agent loops can be besides an environment class: the plug-ins above this package."""

    # the tool loop over the tools of settings.tool_config_path: (settings, tokenizer) -> agent loop
    tool_loop: Optional[Callable[[Any, Any], Any]] = None
    # an entry's `agent:` program: (name, fn, tokenizer, settings, spec=, kwargs=, deadline_s=) -> agent loop
    program_loop: Optional[Callable[..., Any]] = None


class AgentConfigError(UserCodeError):
    """An agent config that cannot run (says which entry and the fix)."""


class EnvironmentLoop:
    """An environment class (or factory) as an agent loop: one instance per episode, made with the entry's kwargs."""

    own_turn_limits = False
    drives_episodes = False  # the loop runs its episodes' rounds

    def __init__(self, name: str, factory: Callable[..., Environment], tokenizer, kwargs: Optional[dict] = None,
                 step_timeout_s: Optional[float] = 60.0):
        self.name, self.factory, self.kwargs = name, factory, dict(kwargs or {})
        self.delta = ChatDelta(tokenizer, list(getattr(factory, "tool_schemas", None) or []))
        self.stop_ids: tuple[int, ...] = ()
        self.step_timeout_s = step_timeout_s

    def make(self, row: EpisodeRow) -> Environment:
        return self.factory(**self.kwargs)

    def close(self) -> None:
        pass


# an entry's keys; environment and agent name the code (one of them), the others tune it
ENTRY_KEYS = ("name", "environment", "agent", "kwargs", "step_timeout_s", "deadline_s")
_KEY = "actor_rollout_ref.rollout.agent.agent_loop_config_path"


def read_agent_config(path: str) -> list[dict]:
    """The entries of an agent config YAML, checked: the file reads as a list, each entry has a unique string name,
    exactly one of environment / agent (a "file.py:Name" or "module:Name" string), only known keys (a misspelt
    one named with the nearest), and kwargs a mapping. Raises AgentConfigError naming the entry and the fix."""
    import yaml

    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            entries = yaml.safe_load(f) or []
    except OSError as e:
        raise AgentConfigError(f"{_KEY}: cannot read {path} ({e.strerror}); give the path of the agent config YAML "
                               "(a list of {name, environment | agent, kwargs})") from None
    except yaml.YAMLError as e:
        raise AgentConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]}); write a list of agents "
                               "(- name: ..., environment: path/to/env.py:MyEnv)") from None
    if not isinstance(entries, list):
        raise AgentConfigError(f"{path}: expected a list of agents (- name: ..., environment: ...)")
    seen = set()
    for k, entry in enumerate(entries):
        _check_entry(entry, f"{path} entry {k}")
        if entry["name"] in seen:
            raise AgentConfigError(f"{path} entry {k}: the name {entry['name']!r} is used twice; give each agent "
                                   "its own")
        seen.add(entry["name"])
    return entries


def _check_entry(entry: Any, where: str) -> None:
    if not isinstance(entry, dict) or not entry.get("name"):
        raise AgentConfigError(f"{where}: each agent needs a name (- name: my_env)")
    if not isinstance(entry["name"], str):
        raise AgentConfigError(f"{where}: the name {entry['name']!r} is not a string; quote it (name: "
                               f"\"{entry['name']}\")")
    where = f"{where} ({entry['name']})"
    unknown = sorted(map(str, set(entry) - set(ENTRY_KEYS)))
    if unknown:
        near = difflib.get_close_matches(unknown[0], ENTRY_KEYS, n=1)
        raise AgentConfigError(f"{where}: unknown key {unknown[0]!r}; " + (f"did you mean {near[0]!r}?" if near
                               else f"the keys are {', '.join(ENTRY_KEYS)}"))
    kinds = [key for key in ("environment", "agent") if entry.get(key)]
    if len(kinds) != 1:
        raise AgentConfigError(f"{where}: give exactly one of environment: (an Environment class) or agent: "
                               "(an agent program's function)")
    if not isinstance(entry[kinds[0]], str):
        raise AgentConfigError(f"{where}: {kinds[0]}: {entry[kinds[0]]!r} is not a string; write it as "
                               "path/to/file.py:Name or package.module:Name")
    if not isinstance(entry.get("kwargs") or {}, dict):
        raise AgentConfigError(f"{where}: kwargs: {entry['kwargs']!r} is not a mapping; write it as "
                               "{key: value, ...} (given to the class or function as keyword arguments)")
    for key in ("step_timeout_s", "deadline_s"):
        value = entry.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise AgentConfigError(f"{where}: {key}: {value!r} is not a number of seconds > 0; use e.g. 60, or "
                                   "leave it out for rollout.agent's")


class AgentLoops:
    """The run's agent loops by name, made when first used (an agent no row names costs nothing)."""

    def __init__(self, settings: Any, tokenizer, makers: dict[str, Callable[[], Any]], default: Optional[str]):
        self.settings, self.tokenizer, self.makers, self.default = settings, tokenizer, makers, default
        self.agents: dict[str, Any] = {}

    @property
    def names(self) -> list[str]:
        return sorted(self.makers)

    def get(self, name: str) -> Any:
        if name not in self.agents:
            if name not in self.makers:
                near = difflib.get_close_matches(name, self.makers, n=1)
                raise AgentConfigError(f"agent_name {name!r} is not an agent of this run (one of {self.names})"
                                       + (f"; did you mean {near[0]!r}?" if near else "") +
                                       ": add it to rollout.agent.agent_loop_config_path")
            self.agents[name] = self.makers[name]()
        return self.agents[name]

    def for_row(self, row: EpisodeRow) -> Any:
        name = row.agent_name or self.default
        if not name:
            raise AgentConfigError("a row has no agent_name and rollout.agent.default_agent_loop is not set")
        return self.get(name)

    def close(self) -> None:
        for agent in self.agents.values():
            agent.close()
        self.agents.clear()


def agent_loops(settings: Any, tokenizer, kinds: LoopKinds) -> AgentLoops:
    """The agent loops of a run (`settings`: `megappo.envs.loop.EpisodeSettings`)."""
    makers: dict[str, Callable[[], Any]] = {}
    if settings.tool_config_path and kinds.tool_loop is not None:
        makers[TOOL_LOOP] = lambda: kinds.tool_loop(settings, tokenizer)
    for name, target in BUILTIN.items():
        makers[name] = (lambda name=name, target=target: EnvironmentLoop(
            name, load_object(target, None, f"built-in agent {name}"), tokenizer, {}, settings.step_timeout_s))
    if settings.agent_config_path:
        base = os.path.dirname(os.path.abspath(settings.agent_config_path))
        for entry in read_agent_config(settings.agent_config_path):
            makers[entry["name"]] = _maker(entry, base, settings, tokenizer, kinds)
    default = settings.default_agent or (TOOL_LOOP if settings.tool_config_path else None)
    return AgentLoops(settings, tokenizer, makers, default)


def _maker(entry: dict, base: str, settings: Any, tokenizer, kinds: LoopKinds) -> Callable[[], Any]:
    where = f"agent {entry['name']}"
    timeout = entry.get("step_timeout_s", settings.step_timeout_s)
    if entry.get("environment"):
        return lambda: EnvironmentLoop(entry["name"], load_object(entry["environment"], base, where), tokenizer,
                                       entry.get("kwargs"), timeout)

    def program() -> Any:
        if kinds.program_loop is None:
            raise AgentConfigError(f"{where}: this run cannot run agent programs (agent: {entry['agent']})")
        target = entry["agent"]
        module, _, function = target.rpartition(":")
        spec = f"{os.path.join(base, module)}:{function}" if module.endswith(".py") and not os.path.isabs(module) \
            else target
        return kinds.program_loop(entry["name"], load_object(target, base, where), tokenizer, settings, spec=spec,
                                  kwargs=entry.get("kwargs"), deadline_s=entry.get("deadline_s"))
    return program
