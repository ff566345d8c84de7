"""`JudgeScorer`: the scorer interface of `megappo.rewards.scorer.RewardScorer` (score(items) -> ScoreResult) over
a generative judge, for the data sources it judges; the other sources go to the rule scorer beside it.

Metrics (in `ScoreResult.stats`, logged as they are): reward/judge_unparsed_fraction (prompts still unparsed after
the retries, of those asked), reward/judge_retries (re-asks), reward/judge_timeouts (calls aborted at their
deadline), perf/judge_samples_per_s (judge prompts per second of engine calls), reward/judge_skipped_groups
(on_unparsed=skip), reward/rule_score_mean: the judged samples' rule reward, computed but not trained on
(log_rule_score), the true accuracy where the rule is exact, and with a user's parser reward/judge_parser_errors
(its calls that raised, returned a non-number or a score outside [0, 1]; `user_parser.py`), which stops the run
(`JudgeParserFailing`) when they pass max_failure_fraction of its calls for max_failure_steps scorings in a row.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from megappo.chat.template import ToolText
from megappo.rewards.judge import templates
from megappo.rewards.judge.loop import Ask, LoopSettings, LoopStats, judge
from megappo.rewards.scorer import ScoreItem, ScoreResult


class JudgeUnparsed(RuntimeError):
    """A verdict that did not parse, with reward_model.judge.on_unparsed=fail."""


class JudgeParserFailing(RuntimeError):
    """A user's parser that keeps failing (raising, returning a non-number or a score outside [0, 1])."""


@dataclass(frozen=True)
class JudgeSettings:
    """What the scorer reads (mapped from reward_model.judge by `megappo.trainer.judge.settings`)."""

    template: str  # the template's text
    pairwise: bool
    use_chat_template: bool
    data_sources: tuple[str, ...]  # empty: every source
    on_unparsed: str  # zero | skip | fail
    failure_score: float
    log_rule_score: bool
    loop: LoopSettings
    # stop when a user's parser fails on more than this fraction of its calls for max_failure_steps scorings in a
    # row (reward_model's: a broken parser is a broken reward function)
    max_failure_fraction: float
    max_failure_steps: int


class JudgeScorer:
    """Scores the judged sources' items with the judge on `engine` (a `RolloutEngine`: rank 0's holder of the
    judge's deployment), the others with `rule` (a RewardScorer; None: every source must be judged)."""

    def __init__(self, engine: Any, tokenizer: Any, parse: Callable[[str], Optional[float]], s: JudgeSettings,
                 rule: Any = None):
        self.engine, self.tokenizer, self.parse, self.s, self.rule = engine, tokenizer, parse, s, rule
        self.guard = ToolText(tokenizer)  # a response's text, tokenised without special-token matching
        self.parser_failing_steps = 0  # scorings in a row where a user's parser failed too often

    def judges(self, data_source: str) -> bool:
        return not self.s.data_sources or data_source in self.s.data_sources

    def score(self, items: Sequence[ScoreItem], watch: bool = True) -> ScoreResult:
        """`watch`: count this scoring against the parser's failure limit (a training step; not validation)."""
        n = len(items)
        judged = [i for i, it in enumerate(items) if self.judges(it.data_source)]
        others = [i for i, it in enumerate(items) if not self.judges(it.data_source)]
        if others and self.rule is None:
            raise ValueError(f"no reward for data sources {sorted({items[i].data_source for i in others})}: "
                             "add them to reward_model.judge.data_sources or keep a rule reward for them")
        out = ScoreResult(torch.full((n,), self.s.failure_score), {}, torch.zeros(n, dtype=torch.bool),
                          torch.zeros(n, dtype=torch.bool), [], torch.zeros(n, dtype=torch.bool), {})
        if others:
            _place(out, self.rule.score([items[i] for i in others]), others)
        if judged:
            self._judge(items, judged, out, watch)
        return out

    def close(self) -> None:
        if self.rule is not None:
            self.rule.close()

    # -- internals ----------------------------------------------------------------------------------------------
    def _judge(self, items: Sequence[ScoreItem], judged: list[int], out: ScoreResult, watch: bool) -> None:
        asks = self._asks(items, judged)
        calls, failures = getattr(self.parse, "calls", 0), getattr(self.parse, "failures", None)
        stats = judge(self.engine, self._decode, self.parse, asks, self.s.loop)
        if failures is not None:  # a user's parser (built-ins do not fail)
            calls, failures = self.parse.calls - calls, self.parse.failures - failures
            out.stats["reward/judge_parser_errors"] = float(failures)
            if watch:
                self._watch_parser(failures, calls)
        if stats.unparsed and self.s.on_unparsed == "fail":
            bad = stats.unparsed[0]
            raise JudgeUnparsed(
                f"the judge's verdict could not be parsed after {self.s.loop.max_retries} retries "
                f"({len(stats.unparsed)} of {len(asks)} prompts this step); e.g. it answered {bad.verdict[:300]!r} "
                f"to {bad.text[-300:]!r}. Fix: make the template ask for the form the parser reads "
                "(reward_model.judge.template / .parser), raise reward_model.judge.max_new_tokens or "
                ".call_timeout_s, or set reward_model.judge.on_unparsed=zero (reward_model.failure_score) or skip")
        scores = self._scores(items, judged, asks)
        for i in judged:
            out.scores[i] = scores[i]
        skipped_groups = self._skip(items, judged, stats, out)
        out.stats.update(_loop_metrics(stats, skipped_groups))
        if self.s.log_rule_score and self.rule is not None:
            rule = self.rule.score([items[i] for i in judged])
            ok = rule.scores[~rule.failed & ~rule.timed_out]
            out.stats["reward/rule_score_mean"] = float(ok.mean()) if ok.numel() else math.nan

    def _watch_parser(self, failures: int, calls: int) -> None:
        fraction = failures / max(calls, 1)
        self.parser_failing_steps = self.parser_failing_steps + 1 if fraction > self.s.max_failure_fraction else 0
        if self.parser_failing_steps >= self.s.max_failure_steps:
            raise JudgeParserFailing(
                f"the judge's parser {self.parse.name} failed on more than reward_model.max_failure_fraction="
                f"{self.s.max_failure_fraction} of the verdicts for {self.parser_failing_steps} steps in a row (last "
                f"step: {failures} of {calls}), so the run stopped instead of training on verdicts it could not "
                "read. Errors: " + "; ".join(self.parse.examples) + ". Fix the parser (it is called as fn(verdict: "
                "str) and returns a score in [0, 1], or None where it cannot read the verdict)")

    def _asks(self, items: Sequence[ScoreItem], judged: list[int]) -> list[Ask]:
        s = self.s
        pairs = [(i,) for i in judged] if not s.pairwise else [
            (a, b) for members in _groups(items, judged).values()
            for k, a in enumerate(members) for b in members[k + 1:]]
        return [self._ask(items, pair) for pair in pairs]

    def _ask(self, items: Sequence[ScoreItem], pair: tuple[int, ...]) -> Ask:
        """The prompt judging `pair`'s responses: shown with them in its text, tokenised with each in a slot of its
        own (`templates.token_ids`: a response cannot forge the judge's control tokens)."""
        s, first = self.s, items[pair[0]]
        fill = templates.fill_pair if s.pairwise else templates.fill
        text = fill(s.template, first.prompt, *[items[i].solution_str for i in pair], first.ground_truth)
        slotted = fill(s.template, first.prompt, *[templates.slot(k) for k in range(len(pair))], first.ground_truth)
        ids = templates.token_ids(self.tokenizer, slotted, s.use_chat_template,
                                  [items[i].solution_str.strip() for i in pair], self.guard)
        return Ask(ids, pair, text)

    def _scores(self, items: Sequence[ScoreItem], judged: list[int], asks: list[Ask]) -> dict[int, float]:
        """Each judged sample's score: its verdict's, or (pairwise) its share of wins over its group's others; an
        unparsed verdict gives failure_score (pairwise: no win to either side)."""
        if not self.s.pairwise:
            return {a.items[0]: self.s.failure_score if a.score is None else a.score for a in asks}
        wins = {i: 0.0 for i in judged}
        for a in asks:
            if a.score is not None:
                wins[a.items[0]] += a.score
                wins[a.items[1]] += 1.0 - a.score
        sizes = {g: len(m) for g, m in _groups(items, judged).items()}
        return {i: wins[i] / (sizes[_group(items, i)] - 1) if sizes[_group(items, i)] > 1 else 0.5 for i in judged}

    def _skip(self, items: Sequence[ScoreItem], judged: list[int], stats: LoopStats, out: ScoreResult) -> int:
        """on_unparsed=skip: every sample of a group with an unparsed verdict is skipped; how many groups."""
        if self.s.on_unparsed != "skip" or not stats.unparsed:
            return 0
        bad = {_group(items, i) for a in stats.unparsed for i in a.items}
        for i in judged:
            if _group(items, i) in bad:
                out.skipped[i] = True
        return len(bad)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _group(items: Sequence[ScoreItem], i: int) -> Any:
    """A sample's group: its uid, or the sample alone when it has none."""
    g = items[i].group
    return ("sample", i) if g is None else g


def _groups(items: Sequence[ScoreItem], judged: list[int]) -> dict[Any, list[int]]:
    out: dict[Any, list[int]] = {}
    for i in judged:
        out.setdefault(_group(items, i), []).append(i)
    return out


def _place(out: ScoreResult, part: ScoreResult, rows: list[int]) -> None:
    """Write a scorer's result for `rows` of the batch into `out`."""
    index = torch.tensor(rows, dtype=torch.long)
    out.scores[index] = part.scores
    out.failed[index] = part.failed
    out.timed_out[index] = part.timed_out
    out.errors += [f"{e} (of the rule-scored samples)" for e in part.errors]
    for name, values in part.extras.items():
        out.extras.setdefault(name, torch.full_like(out.scores, math.nan))[index] = values
    out.stats.update(part.stats)


def _loop_metrics(stats: LoopStats, skipped_groups: int) -> dict[str, float]:
    return {"reward/judge_unparsed_fraction": len(stats.unparsed) / max(stats.asked, 1),
            "reward/judge_retries": float(stats.retries), "reward/judge_timeouts": float(stats.timeouts),
            "perf/judge_samples_per_s": stats.asked / stats.seconds if stats.seconds > 0 else 0.0,
            "reward/judge_skipped_groups": float(skipped_groups)}
