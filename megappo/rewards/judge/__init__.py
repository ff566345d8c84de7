"""A generative judge as the reward (reward_model.judge): templates (`templates.py`), verdict parsers
(`parsers.py`), the batched judging loop with deadlines and retries (`loop.py`) and the scorer the trainer calls
(`scorer.py`: `JudgeScorer`, with the rule scorer for the sources it does not judge)."""
from megappo.rewards.judge.loop import Ask, LoopSettings, LoopStats, judge
from megappo.rewards.judge.parsers import get_parser, parse_number, parse_pairwise, parse_yes_no
from megappo.rewards.judge.scorer import JudgeScorer, JudgeSettings, JudgeUnparsed

__all__ = ["Ask", "JudgeScorer", "JudgeSettings", "JudgeUnparsed", "LoopSettings", "LoopStats", "get_parser", "judge",
           "parse_number", "parse_pairwise", "parse_yes_no"]
