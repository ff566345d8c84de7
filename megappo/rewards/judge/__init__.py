"""A generative judge as the reward (reward_model.judge): templates (`templates.py`), verdict parsers
(`parsers.py`; a user's is checked and guarded by `user_parser.py`), the batched judging loop with deadlines and
retries (`loop.py`) and the scorer the trainer calls (`scorer.py`: `JudgeScorer`, with the rule scorer for the
sources it does not judge)."""
from megappo.rewards.judge.loop import Ask, LoopSettings, LoopStats, judge
from megappo.rewards.judge.parsers import get_parser, parse_number, parse_pairwise, parse_yes_no
from megappo.rewards.judge.scorer import JudgeParserFailing, JudgeScorer, JudgeSettings, JudgeUnparsed
from megappo.rewards.judge.user_parser import JudgeParserError, UserParser

__all__ = ["Ask", "JudgeParserError", "JudgeParserFailing", "JudgeScorer", "JudgeSettings", "JudgeUnparsed",
           "LoopSettings", "LoopStats", "UserParser", "get_parser", "judge", "parse_number", "parse_pairwise",
           "parse_yes_no"]
