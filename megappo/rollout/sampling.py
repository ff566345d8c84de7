"""Sampling parameters, completions and the next-token sampler of megappo's rollout engines.

The names follow SGLang's `sampling_params` (max_new_tokens, temperature, top_p, top_k, n, stop_token_ids,
ignore_eos), so the in-process engine and an SGLang server take the same request.

Which distribution a log-prob is under is decided in one place, `SamplingParams.logprob_temperature`: a sampled
token's log-prob is taken under softmax(logits / T) *before* top-k/top-p filtering, with T the sampling temperature,
and under softmax(logits) (T = 1) for greedy decoding (temperature 0 or top_k 1, where dividing by 0 is undefined).
The trainer recomputes exactly that quantity with `compute_log_probs(..., temperature=params.logprob_temperature)`,
so rollout and training log-probs can be compared token for token.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch


def check_prompts(prompts: Sequence[Sequence[int]]) -> None:
    """Refuse a batch with no prompt or an empty one (every engine asks before it generates)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")


def check_scored(sequences: Sequence[Sequence[int]]) -> None:
    """Refuse a sequence too short to score: log p(token k | tokens before) needs a token before."""
    if any(len(s) < 2 for s in sequences):
        raise ValueError("prompt log-probs need at least two tokens")


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0  # 0 (or greedy=True): argmax
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    n: int = 1  # completions per prompt
    greedy: bool = False
    ignore_eos: bool = False  # generate max_new_tokens whatever is sampled (stop_token_ids too, as in SGLang)
    stop_token_ids: tuple[int, ...] = ()  # besides the model's EOS tokens
    seed: Optional[int] = None  # the engine's generator seed for this request (None: the engine's stream)
    # one seed per row (n = 1): each prompt's own seed, whatever request it is batched in (the agent endpoint's calls,
    # whose batches depend on when agents call); overrides `seed`
    row_seeds: Optional[tuple[int, ...]] = None
    # MoE router replay (R3): also return each token's routed experts (`Completion.routed_experts`), SGLang's name
    return_routed_experts: bool = False

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0 or self.top_k == 1

    @property
    def logprob_temperature(self) -> float:
        """The temperature of the distribution that reported log-probs are under (see the module docstring)."""
        return 1.0 if self.is_greedy else float(self.temperature)


@dataclass
class Completion:
    """One sampled response."""

    prompt_index: int  # index of its prompt in the request
    output_ids: list[int]  # the response tokens, the stop token included when one ended it
    log_probs: list[float]  # per output token, under softmax(logits / params.logprob_temperature)
    finish_reason: str  # "stop" (EOS or a stop token), "length", or "abort" (engine.abort(): the tokens it had)
    weight_version: int = 0  # the engine's weights when it was sampled (its first token's)
    extra: dict = field(default_factory=dict)
    # per output token, the weights' version that produced it (a generation continued across a weight sync holds
    # two or more); None: every token is `weight_version`'s
    token_versions: Optional[list[int]] = None
    # with SamplingParams.return_routed_experts on a MoE model: [P + R - 1, L, k] uint8 (int16 past 256 experts),
    # the experts the engine routed each fed token to (prompt, then the response but its last token) in each of its
    # L MoE layers
    routed_experts: Optional[torch.Tensor] = None

    def versions(self) -> list[int]:
        """Per output token, the version that produced it."""
        return list(self.token_versions) if self.token_versions is not None else \
            [self.weight_version] * len(self.output_ids)


def _distributions(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (log-probs [B, V] the reported ones are under, the top-k/top-p filtered probs [B, V])."""
    logits = logits.float()
    if params.logprob_temperature != 1.0:  # x / 1 is x: one op less a decode step
        logits = logits / params.logprob_temperature
    logp = torch.log_softmax(logits, -1)
    filtered = logits.clone() if params.top_k > 0 or params.top_p < 1.0 else logits  # filtered in place below
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(filtered, params.top_k, dim=-1).values[..., -1:]
        filtered[filtered < kth] = float("-inf")
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(filtered, dim=-1, descending=True)
        cum = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, -1) >= params.top_p  # keep the smallest set reaching top_p
        sorted_logits[drop] = float("-inf")
        filtered = torch.full_like(filtered, float("-inf")).scatter(-1, order, sorted_logits)
    return logp, torch.softmax(filtered, -1)


def sample_next(logits: torch.Tensor, params: SamplingParams,
                generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (float) -> (tokens [B] long, log-probs [B] of those tokens, see the module docstring)."""
    if params.is_greedy:
        scaled = logits.float() / params.logprob_temperature
        logp, tokens = torch.log_softmax(scaled, -1), scaled.argmax(-1)
    else:
        logp, probs = _distributions(logits, params)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def sample_rows(logits: torch.Tensor, params: SamplingParams,
                generators: Sequence[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_next` of each row r of logits [B, V] with its own generator `generators[r]`, in one batched pass:
    row r draws the token `sample_next(logits[r:r + 1], params, generators[r])` draws (the same noise from the same
    generator state, leaving it where that call leaves it). One-sample `torch.multinomial` draws V exponentials
    q from the generator and takes argmax(probs / q); the rows' draws are those V-element draws, row by row (the one
    per-row call of a decode step: a few microseconds a row beside the forward, see tools/bench/bench_hf_generate)."""
    logp, probs = _distributions(logits, params)
    noise = torch.empty_like(probs)
    for row, generator in zip(noise, generators):
        row.exponential_(generator=generator)
    tokens = (probs / noise).argmax(-1)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
