"""The judging loop: judge prompts in batches of `batch_size` engine calls, each under a deadline, verdicts parsed,
the unparsed ones asked again with a new seed up to `max_retries` times.

An engine call that passes `call_timeout_s` is aborted (`RolloutEngine.abort`: the generation ends at its next
decode step) and its prompts count as unparsed for that try ("no verdict within the deadline"). Every prompt is
drawn with a seed of its own tokens and its try (`ask_seed`, the engines' `row_seeds`): a verdict does not depend on
how the prompts were batched, which step asked, or whether the run was resumed in between.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from megappo.rollout.sampling import SamplingParams

NO_VERDICT = "(no verdict: the judge's call passed reward_model.judge.call_timeout_s)"


@dataclass
class Ask:
    """One judge prompt and what became of it."""

    ids: list[int]  # the prompt's tokens
    items: tuple[int, ...]  # the samples it judges: (i,) or, pairwise, (a, b)
    text: str = ""  # the filled template (for messages)
    verdict: str = ""  # the last decoded answer
    score: Optional[float] = None  # the parsed score; None: unparsed after every try


@dataclass
class LoopStats:
    asked: int = 0  # prompts
    retries: int = 0  # re-asks of unparsed prompts
    timeouts: int = 0  # calls aborted at their deadline
    calls: int = 0  # engine calls
    seconds: float = 0.0  # wall time in engine calls
    unparsed: list[Ask] = field(default_factory=list)  # prompts still unparsed after every try


@dataclass(frozen=True)
class LoopSettings:
    batch_size: int
    call_timeout_s: float
    max_retries: int
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int


def ask_seed(seed: int, ids: Sequence[int], attempt: int) -> int:
    """The seed a verdict is drawn with: of the judge's seed, the prompt's tokens and the try, and nothing else, so a
    prompt draws the same verdict whatever it was batched with, whichever step asked, and after a resume."""
    digest = hashlib.blake2b(struct.pack(f"<{len(ids)}q", *ids), digest_size=8, key=struct.pack("<qq", seed, attempt))
    return int.from_bytes(digest.digest(), "little") & (2**62 - 1)


def judge(engine: Any, decode: Callable[[list[int]], str], parse: Callable[[str], Optional[float]],
          asks: Sequence[Ask], s: LoopSettings) -> LoopStats:
    """Fill each ask's verdict and score (None where it never parsed). Each try of each prompt is drawn with its own
    seed (`ask_seed`)."""
    stats = LoopStats(asked=len(asks))
    pending = list(range(len(asks)))
    for attempt in range(s.max_retries + 1):
        if not pending:
            break
        if attempt:
            stats.retries += len(pending)
        still = []
        for start in range(0, len(pending), s.batch_size):
            rows = pending[start:start + s.batch_size]
            params = SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                                    greedy=s.temperature == 0,
                                    row_seeds=tuple(ask_seed(s.seed, asks[r].ids, attempt) for r in rows))
            verdicts = _call(engine, [asks[r].ids for r in rows], params, start, s.call_timeout_s, stats)
            for r, verdict in zip(rows, verdicts):
                asks[r].verdict = NO_VERDICT if verdict is None else decode(verdict)
                asks[r].score = None if verdict is None else parse(asks[r].verdict)
                if asks[r].score is None:
                    still.append(r)
        pending = still
    stats.unparsed = [asks[r] for r in pending]
    return stats


def _call(engine: Any, prompts: list[list[int]], params: SamplingParams, offset: int, timeout_s: float,
          stats: LoopStats) -> list[Optional[list[int]]]:
    """One engine call: each prompt's answer tokens, None for all of them past the deadline."""
    t0 = time.perf_counter()
    future = engine.submit(prompts, params, prompt_offset=offset)
    try:
        grouped = future.result(timeout=timeout_s)
        out: list[Optional[list[int]]] = [list(g[0].output_ids) for g in grouped]
    except concurrent.futures.TimeoutError:
        while True:  # an abort that lands before the call has started is lost (the call clears it): abort again
            engine.abort()
            try:
                future.result(timeout=0.5)  # the aborted call returns at its next decode step: the engine is free
                break
            except concurrent.futures.TimeoutError:
                continue
        stats.timeouts += 1
        out = [None] * len(prompts)
    stats.calls += 1
    stats.seconds += time.perf_counter() - t0
    return out
