"""A trajectory's calls as one training sample.

The trajectory's LAST segment is the sample: its first call's prompt is the prompt, and everything after it is the
response: the model's tokens (loss mask 1, their engine log-probs and weight versions) and, between turns, the
template's and the client's tokens (mask 0, log-prob 0, version -1), cut to the response budget. The last segment is
the one the final answer, and so the reward, belong to. Earlier segments (a history the agent rewrote: summarised,
edited) are counted, not trained on: their model tokens are `dropped_tokens`, and the calls that started a segment
are `retokenized_calls` (`agent/retokenized_fraction` = retokenized calls / calls).

A trajectory without a call (the agent raised or timed out first, or never called) gives an empty response with
`finish_reason` "abort" and `no_calls` set, so the trainer keeps the sample (never lost) and can count it; its prompt
is the one the caller gives (the row's prompt rendered).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from megappo.agents.records import TrajectoryRecord


@dataclass
class StitchedSample:
    prompt_ids: list[int]
    response_ids: list[int]  # [R], R <= the response budget
    loss_mask: list[int]  # [R]: 1 on the model's tokens
    log_probs: list[float]  # [R]: the engine's, 0.0 where the mask is 0
    versions: list[int]  # [R]: the weight version of each model token, -1 where the mask is 0
    finish_reason: str  # the last call's; "length" when the budget cut the response; "abort" without calls
    calls: int
    segments: int
    retokenized_calls: int
    dropped_tokens: int  # model tokens of earlier segments (not trained on)
    truncated_tokens: int  # response tokens past the budget (not trained on)

    @property
    def no_calls(self) -> bool:
        return self.calls == 0

    def stats(self) -> dict[str, float]:
        return {"calls": self.calls, "segments": self.segments, "retokenized_calls": self.retokenized_calls,
                "dropped_tokens": self.dropped_tokens, "truncated_tokens": self.truncated_tokens,
                "no_calls": float(self.no_calls)}


def stitch(record: TrajectoryRecord, response_budget: int, empty_prompt: Sequence[int] = ()) -> StitchedSample:
    """The record's last segment as a sample (see the module docstring); `empty_prompt`: the prompt of a trajectory
    without calls."""
    retokenized = sum(c.retokenized for c in record.calls)
    if not record.segments:
        return StitchedSample(list(empty_prompt), [], [], [], [], "abort", len(record.calls), 0, retokenized, 0, 0)
    last = record.segments[-1]
    dropped = sum(sum(s.mask) for s in record.segments[:-1])
    response = last.ids[last.prompt_len:]
    keep = max(response_budget, 0)
    finish = record.calls[-1].finish_reason if record.calls else "abort"
    if len(response) > keep:
        finish = "length"
    return StitchedSample(list(last.ids[:last.prompt_len]), response[:keep], last.mask[:keep],
                          last.log_probs[:keep], last.versions[:keep], finish, len(record.calls),
                          len(record.segments), retokenized, dropped, max(len(response) - keep, 0))
