"""An agent program for the guess_number task, written against the `openai` client as any agent is: megappo serves
the policy behind an OpenAI-compatible endpoint and calls `play` once per episode with its address and the episode's
own key (recipes/cpu/tiny_openai_agent_ppo.yaml). The game's rules are the built-in environment's."""
from __future__ import annotations

import openai

from megappo.envs.guess_number import GuessNumberEnv


def play(base_url: str, api_key: str, row) -> float:
    """One episode: the model guesses, the game answers "higher" or "lower", until it is right or out of guesses.
    Returns the episode's reward (1.0 for a right guess)."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    game = GuessNumberEnv()
    messages = game.start(row)
    reward = 0.0
    try:
        while True:
            reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
            said = {"role": "assistant", "content": reply.choices[0].message.content or ""}
            step = game.step(said)
            reward += step.reward
            if step.done:
                return reward
            messages = messages + [said] + step.messages
    finally:
        game.close()
        client.close()
