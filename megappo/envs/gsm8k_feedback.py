"""GSM8K with a checker's feedback (verl's gsm8k interaction, examples/sglang_multiturn): the model answers; a wrong
answer is told so and may try again, up to `max_turns` answers. Reward 1.0 for the first right answer, else 0.0
(GSM8K's rule: the number after `####`, megappo.rewards.gsm8k)."""
from __future__ import annotations

from megappo.envs.base import EnvStep, Environment, EpisodeRow

RETRY = "Your response is incorrect! You need to reflect on your answer and try again."


class Gsm8kFeedback(Environment):
    def __init__(self, max_turns: int = 3):
        self.max_turns, self.turns, self.answer = max_turns, 0, None

    def start(self, row: EpisodeRow) -> list[dict]:
        self.answer = row.ground_truth
        self.max_turns = int(row.extra_info.get("max_turns", self.max_turns))
        return row.prompt

    def step(self, assistant: dict) -> EnvStep:
        from megappo.rewards import gsm8k

        self.turns += 1
        if gsm8k.compute_score(assistant["content"], self.answer) >= 1.0:
            return EnvStep(reward=1.0, done=True, metrics={"solved_at_turn": float(self.turns)})
        if self.turns >= self.max_turns:
            return EnvStep(done=True, truncated=True)
        return EnvStep([{"role": "user", "content": RETRY}])
