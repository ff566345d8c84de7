"""The environment interface: what a user implements, in one file, to train on a multi-step task.

    class GuessNumber(Environment):
        def start(self, row: EpisodeRow) -> list[dict]:
            self.secret = int(row.ground_truth)
            return row.prompt                                   # the first messages: the model answers them

        def step(self, assistant: dict) -> EnvStep:
            guess = parse(assistant["content"])
            if guess == self.secret:
                return EnvStep(reward=1.0, done=True)
            return EnvStep([{"role": "user", "content": "higher" if guess < self.secret else "lower"}])

An episode is one object, made per sample by its factory (the class, or any callable taking the entry's kwargs),
given its dataset row once (`start`), then the model's message after each of its turns (`step`) until a step says
`done` or the episode's budget (tokens, turns, deadline) ends it; `close` is called always: after `done`, after a
budget or deadline end, and after `start` or `step` raised. An episode's reward is the sum of its steps' rewards; the
trainer's reward function reads it (`extra_info["env_reward"]`, `megappo.envs.rewards.env_reward`).

Messages are chat messages ({"role", "content"}, OpenAI's shape). The environment's messages (role "user" or "tool")
are untrusted text: they are escaped and tokenised alone, never as the template's control tokens
(`megappo.chat.template.ChatDelta`). The model's turns are its sampled tokens, never re-tokenised.

A step runs in the loop's pool with a deadline (`rollout.agent.step_timeout_s`): a step past it ends the episode
(`env/timeout_fraction`); one that raises ends it too (`env/error_fraction`), and the sample is kept with the tokens
it has, so a batch never loses or duplicates a sample.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class EpisodeRow:
    """An episode's dataset row (verl's columns) and which sample of it the episode is."""

    prompt: list[dict]  # the row's chat messages (`prompt` column)
    data_source: str
    ground_truth: Any  # reward_model.ground_truth
    extra_info: dict  # the row's extra_info (verl's tools_kwargs and interaction_kwargs live here)
    index: int  # the row's position in the dataset
    sample: int = 0  # which of the prompt's `rollout.n` samples
    seed: Optional[int] = None  # the sample's own seed (None: unseeded run); an environment that draws uses it
    agent_name: Optional[str] = None  # the row's `agent_name` column (None: rollout.agent.default_agent_loop)

    @property
    def tools_kwargs(self) -> dict:
        """verl's per-row tool arguments: `extra_info.tools_kwargs` ({tool name: {create_kwargs: ...}})."""
        return dict(self.extra_info.get("tools_kwargs") or {})


@dataclass
class EnvStep:
    """What the environment answers to one assistant message."""

    messages: list[dict] = field(default_factory=list)  # its messages, shown to the model before its next turn
    reward: float = 0.0  # added to the episode's reward
    done: bool = False  # the episode is over (the messages, if any, are not shown)
    truncated: bool = False  # with done: it ended at a limit (turns), not by its task (gym's truncated)
    metrics: dict[str, float] = field(default_factory=dict)  # averaged over the step's episodes as env/<key>


class Environment(ABC):
    """One episode of a multi-step task (see the module docstring)."""

    # OpenAI-format tool schemas the chat template shows the model (the `tools=` of `apply_chat_template`)
    tool_schemas: list[dict] = []

    @abstractmethod
    def start(self, row: EpisodeRow) -> list[dict]:
        """The episode's first messages, which the model answers (usually `row.prompt`)."""

    @abstractmethod
    def step(self, assistant: dict) -> EnvStep:
        """The environment's answer to the model's message (`{"role": "assistant", "content": text}`)."""

    def close(self) -> None:
        """Release what the episode holds (called once, always)."""
