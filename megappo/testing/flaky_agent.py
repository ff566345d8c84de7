"""A guess_number agent program whose own service fails in a share of its episodes, for the tests and benchmarks of
failed episodes (`rollout.agent.on_failure`). Name it in an agent config as an agent program:

    - name: guess_number
      agent: megappo.testing.flaky_agent:play
      kwargs: {share: 0.2}

It plays as recipes/cpu/agents/guess_agent.py does; in the episodes a hash of the episode's seed picks (`fails`: the
same episodes in every run, independent of everything the episode samples) it raises right after its first call."""
from __future__ import annotations

import hashlib

import openai

from megappo.envs.guess_number import GuessNumberEnv

ERROR = "the agent's own service is down"


def fails(seed, share: float) -> bool:
    """Whether the episode of this seed fails (a share `share` of all seeds)."""
    return seed is not None and int(hashlib.sha256(f"fail-{seed}".encode()).hexdigest(), 16) % 10_000 < share * 10_000


def play(base_url: str, api_key: str, row, share: float = 0.2) -> float:
    failing = fails(row.seed, share)
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    game, reward = GuessNumberEnv(), 0.0
    messages = game.start(row)
    try:
        while True:
            reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
            if failing:
                raise ConnectionError(ERROR)
            said = {"role": "assistant", "content": reply.choices[0].message.content or ""}
            step = game.step(said)
            reward += step.reward
            if step.done:
                return reward
            messages = messages + [said] + step.messages
    finally:
        game.close()
        client.close()
