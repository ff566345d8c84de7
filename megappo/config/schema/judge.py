"""The configuration tree's `reward_model.judge` section (importable from `megappo.config.schema`): a generative
reward model, a "judge" that reads a prompt made of the question and the response (and the reference answer) and
writes a verdict that a parser turns into a score (megappo/rewards/judge/).

verl has no judge of this shape in its trainer config: its GenRM example (recipe/genrm_remote) is a custom reward
function that posts each response to an OpenAI-compatible server and parses a boxed number. megappo serves the
judge on its own engines (a fleet of its own, `megappo.rollout.fixed`) so the trainer starts and stops it, batches
its calls and counts what it could not parse. `reward_model.enable` keeps meaning verl's discriminative (value-head)
reward model; the two are exclusive.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from megappo.config.schema.rollout import InferenceConfig

# parser names built in (megappo/rewards/judge/parsers.py); anything else must be "path.py:name" or "module:name"
BUILTIN_PARSERS = ("number", "yes_no", "pairwise")


@dataclass
class JudgeConfig:
    """A generative judge as the reward of the data sources it judges (all of them, or `data_sources`)."""

    enable: bool = False
    path: Optional[str] = None  # the judge's Hugging Face directory (model and tokenizer)
    # a built-in judge the trainer makes (megappo.tasks, e.g. digit_max_judge) under
    # <trainer.default_local_dir>/synthetic/<builtin>/ and points `path` at; None: `path`
    builtin: Optional[str] = None
    # the data sources the judge scores; the others keep their rule reward. Empty: every source is judged
    data_sources: list[str] = field(default_factory=list)
    # a built-in template's name (megappo/rewards/judge/templates.py: default, digit_max, pairwise) or the template
    # itself, with {question}, {response} and optionally {ground_truth}; pairwise: {response_a} and {response_b}
    template: str = "default"
    use_chat_template: bool = True  # wrap the filled template in the judge tokenizer's chat template, if it has one
    # number: the last number of the verdict, in [number_min, number_max], mapped to [0, 1]; yes_no: yes -> 1,
    # no -> 0; pairwise: A or B, each of a group's pairs judged once and a sample's score its share of wins;
    # "path.py:name" / "module:name": fn(verdict: str) -> a score in [0, 1], or None where it cannot read it (its
    # signature checked at setup; a call that raises or returns anything else is an unparsed verdict, counted)
    parser: str = "yes_no"
    number_min: float = 0.0
    number_max: float = 10.0
    # sampling of the verdicts: greedy by default (a verdict should not depend on the draw); retries of an unparsed
    # verdict draw with a new seed, so greedy retries only help a judge that timed out
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    seed: int = 0
    batch_size: int = 64  # judge prompts per engine call
    call_timeout_s: float = 120.0  # one call's deadline: past it the call is aborted and its prompts retried
    max_retries: int = 2  # re-asks of a prompt whose verdict did not parse (or whose call timed out)
    # what a verdict that still does not parse becomes: zero (reward_model.failure_score), skip (its prompt's
    # group trains on nothing this step), fail (stop the run, quoting the verdict)
    on_unparsed: Literal["zero", "skip", "fail"] = "zero"
    # also score the judged samples with their data source's rule reward, not trained on: reward/rule_score_mean
    # (the true accuracy beside the judge's), when a rule is registered for the source (or a custom function is set)
    log_rule_score: bool = True
    inference: InferenceConfig = field(default_factory=InferenceConfig)  # the judge's engine (unset: the rollout's)
