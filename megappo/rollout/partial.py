"""Generations continued across a weight sync (async_training.partial_rollout): an aborted sample goes on from its
prompt and the tokens it has, with the weights now, and each token keeps the version that produced it."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional, Sequence

import torch

from megappo.rollout.sampling import Completion, SamplingParams
from megappo.rollout.seeds import sample_seed


def continued(engine: Any, prompts: Sequence[Sequence[int]], done: list[list[Completion]], params: SamplingParams,
              prompt_offset: int, round_: int, request: dict) -> list[list[Completion]]:
    """`RolloutEngine.continue_generation` for single-turn samples: the aborted ones of `done`, grouped by the budget
    they have left, each group one request (seeded by the share's offset, the round and the budget)."""
    todo = [(k, j, c) for k, group in enumerate(done) for j, c in enumerate(group) if c.finish_reason == "abort"]
    by_budget: dict[int, list] = {}
    for k, j, c in todo:
        by_budget.setdefault(params.max_new_tokens - len(c.output_ids), []).append((k, j, c))
    images = request.get("multi_modal")
    out = [list(group) for group in done]
    for budget, rows in sorted(by_budget.items()):
        seed = None if params.seed is None else sample_seed(params.seed, prompt_offset, round_, budget)
        more = engine.generate([list(prompts[k]) + list(c.output_ids) for k, _, c in rows],
                               replace(params, n=1, max_new_tokens=budget, seed=seed),
                               **({"multi_modal": [images[k] for k, _, _ in rows]} if images else {}))
        for (k, j, c), (tail,) in zip(rows, more):
            fresh = not c.output_ids
            out[k][j] = Completion(
                prompt_index=c.prompt_index, output_ids=list(c.output_ids) + list(tail.output_ids),
                log_probs=list(c.log_probs) + list(tail.log_probs), finish_reason=tail.finish_reason,
                weight_version=tail.weight_version if fresh else c.weight_version,
                extra={**c.extra, "partial": c.extra.get("partial", False) or not fresh},
                token_versions=c.versions() + tail.versions(),
                routed_experts=_joined_routes(c, tail, len(prompts[k])))
    return out


def _joined_routes(c: Completion, tail: Completion, prompt_len: int) -> Optional[torch.Tensor]:
    """Router replay: each token's routes as the engine used them to sample, the first request's up to its last
    token (which the continuation fed first) and the continuation's after."""
    if tail.routed_experts is None or c.routed_experts is None or not c.output_ids:
        return tail.routed_experts
    cut = prompt_len + len(c.output_ids) - 1
    return torch.cat([c.routed_experts[:cut], tail.routed_experts[cut:]])
