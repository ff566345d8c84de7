"""Typed batches that the model compute functions take.

A batch holds B sequences of T = P + R tokens: a prompt left-padded to P and a response right-padded to R, so
every response starts at column P and "the last R positions are the response". Per-token outputs (log-probs,
entropy, values) and the per-token training inputs are [B, R], aligned with the response tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Optional, Sequence, Union

import torch

if TYPE_CHECKING:
    from megappo.data.multimodal import MultiModalInputs

Index = Union[torch.Tensor, Sequence[int], slice]


def _index_rows(rows: Optional[list], idx: Index) -> Optional[list]:
    if rows is None:
        return None
    if isinstance(idx, slice):
        return rows[idx]
    return [rows[int(i)] for i in torch.as_tensor(idx, dtype=torch.long).tolist()]


def _pad_rows(rows: Optional[list], extra: int) -> Optional[list]:
    """Per-row objects of a batch grown by `extra` all-padding rows (None for each)."""
    if rows is None:
        return None
    return list(rows) + [None] * extra


def _check_rows(name: str, rows: Optional[list], b: int, absent: str) -> None:
    if rows is not None and len(rows) != b:
        raise ValueError(f"ModelBatch: {name} has {len(rows)} entries for {b} rows; give one per row ({absent})")


def _index(t: Optional[torch.Tensor], idx: Index) -> Optional[torch.Tensor]:
    if t is None:
        return None
    if isinstance(idx, slice):
        return t[idx]
    return t.index_select(0, torch.as_tensor(idx, dtype=torch.long, device=t.device))


@dataclass
class TrainInputs:
    """Per-token inputs of the PPO losses; every field is optional and, when set, [B, R] float (the top-k
    distillation fields [B, R, K])."""

    old_log_probs: Optional[torch.Tensor] = None  # [B, R] log-probs of the policy that sampled the response
    ref_log_probs: Optional[torch.Tensor] = None  # [B, R] log-probs of the frozen reference model
    advantages: Optional[torch.Tensor] = None  # [B, R]
    returns: Optional[torch.Tensor] = None  # [B, R] value targets
    values: Optional[torch.Tensor] = None  # [B, R] critic values at rollout time (value clipping)
    rollout_is_weights: Optional[torch.Tensor] = None  # [B, R] old / rollout importance weights (rollout correction)
    pg_token_mask: Optional[torch.Tensor] = None  # [B, R] 1 where the policy gradient trains (top_entropy_quantile)
    teacher_log_probs: Optional[torch.Tensor] = None  # [B, R] a distillation teacher's log-probs of the tokens
    teacher_topk_log_probs: Optional[torch.Tensor] = None  # [B, R, K] the teacher's top-k tokens' log-probs
    teacher_topk_ids: Optional[torch.Tensor] = None  # [B, R, K] long, those tokens

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def select(self, idx: Index) -> "TrainInputs":
        """Rows `idx` (a slice, index list or LongTensor) of every tensor."""
        return TrainInputs(**{k: _index(v, idx) for k, v in self.tensors().items()})

    def crop(self, r: int) -> "TrainInputs":
        """The first `r` response columns (a micro-batch padded only to its own longest response)."""
        return TrainInputs(**{k: v[:, :r] for k, v in self.tensors().items()})

    def to(self, device: Union[str, torch.device]) -> "TrainInputs":
        return TrainInputs(**{k: v.to(device) for k, v in self.tensors().items()})


@dataclass
class ModelBatch:
    """B sequences: prompt left-padded to P, response right-padded to R, T = P + R."""

    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] 1 on real tokens, 0 on padding (left of prompts, right of responses)
    position_ids: torch.Tensor  # [B, T] long, 0 at each sequence's first real token
    response_mask: torch.Tensor  # [B, R] 1 on response tokens to score/train, 0 on padding
    train: Optional[TrainInputs] = None
    # vision-language rows: each row's images (None: a text row), kept with the row by select / crop / pad_to;
    # None for a text batch (see megappo.kinds.qwen2_vl.inputs)
    multi_modal: Optional[list[Optional["MultiModalInputs"]]] = None
    # MoE router replay: [B, T, L, k] uint8 (int16 past 256 experts), each token's experts in each MoE layer, aligned
    # with input_ids (zeros where there is no route: padding, a sequence's last token); megappo.models.router_replay
    routes: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        b, t = self.input_ids.shape
        if self.routes is not None and (self.routes.dim() != 4 or tuple(self.routes.shape[:2]) != (b, t)):
            raise ValueError(f"ModelBatch: routes {tuple(self.routes.shape)} must be [B={b}, T={t}, layers, top_k]")
        _check_rows("multi_modal", self.multi_modal, b, "None for a row without images")
        if self.attention_mask.shape != (b, t) or self.position_ids.shape != (b, t):
            raise ValueError(
                f"ModelBatch: attention_mask {tuple(self.attention_mask.shape)} and position_ids "
                f"{tuple(self.position_ids.shape)} must both have input_ids' shape {(b, t)}"
            )
        if self.response_mask.dim() != 2 or self.response_mask.shape[0] != b or self.response_mask.shape[1] > t:
            raise ValueError(
                f"ModelBatch: response_mask {tuple(self.response_mask.shape)} must be [B={b}, R] with R <= T={t} "
                "(the last R columns of input_ids are the response)"
            )
        if self.train is not None:
            for name, v in self.train.tensors().items():
                if tuple(v.shape[:2]) != tuple(self.response_mask.shape):
                    raise ValueError(
                        f"ModelBatch: train.{name} has shape {tuple(v.shape)}; it must equal response_mask's "
                        f"{tuple(self.response_mask.shape)}"
                    )

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    @property
    def response_len(self) -> int:
        return self.response_mask.shape[1]

    @property
    def prompt_len(self) -> int:
        return self.seq_len - self.response_len

    def select(self, idx: Index) -> "ModelBatch":
        """Rows `idx` (a slice, index list or LongTensor) of every tensor, train inputs included."""
        return ModelBatch(
            input_ids=_index(self.input_ids, idx),
            attention_mask=_index(self.attention_mask, idx),
            position_ids=_index(self.position_ids, idx),
            response_mask=_index(self.response_mask, idx),
            train=None if self.train is None else self.train.select(idx),
            multi_modal=_index_rows(self.multi_modal, idx),
            routes=_index(self.routes, idx),
        )

    def slice(self, start: int, end: int) -> "ModelBatch":
        return self.select(slice(start, end))

    def crop(self, prompt_len: int, response_len: int) -> "ModelBatch":
        """Keep the last `prompt_len` prompt columns and the first `response_len` response columns.

        Cropping only padding (see `prompt_lengths` / `response_lengths`) leaves every model output unchanged:
        position ids travel with their tokens and padding is masked out of attention.
        """
        p0 = self.prompt_len - prompt_len
        end = self.prompt_len + response_len
        if p0 < 0 or response_len > self.response_len:
            raise ValueError(f"crop({prompt_len}, {response_len}) exceeds the batch's P={self.prompt_len}, "
                             f"R={self.response_len}")
        return ModelBatch(
            input_ids=self.input_ids[:, p0:end],
            attention_mask=self.attention_mask[:, p0:end],
            position_ids=self.position_ids[:, p0:end],
            response_mask=self.response_mask[:, :response_len],
            train=None if self.train is None else self.train.crop(response_len),
            multi_modal=self.multi_modal,
            routes=None if self.routes is None else self.routes[:, p0:end],
        )

    def pad_to(self, rows: int, prompt_len: int, response_len: int, pad_token_id: int = 0) -> "ModelBatch":
        """Grow to [rows, prompt_len + response_len]: prompts padded on the left, responses on the right, and
        all-padding rows appended (attention_mask and response_mask 0, so they add nothing to any masked loss)."""
        b, p, r = self.batch_size, self.prompt_len, self.response_len
        if (rows, prompt_len, response_len) == (b, p, r):
            return self
        if rows < b or prompt_len < p or response_len < r:
            raise ValueError(f"pad_to({rows}, {prompt_len}, {response_len}) is smaller than the batch's "
                             f"B={b}, P={p}, R={r}")
        left, right, extra = prompt_len - p, response_len - r, rows - b

        def grow(t: torch.Tensor, fill: float, lo: int, hi: int) -> torch.Tensor:
            inner = (0, 0) * (t.dim() - 2)  # a trailing per-token dimension (top-k) is not padded
            return torch.nn.functional.pad(t, (*inner, lo, hi, 0, extra), value=fill)

        train = None
        if self.train is not None:
            train = TrainInputs(**{k: grow(v, 0.0, 0, right) for k, v in self.train.tensors().items()})
        return ModelBatch(
            input_ids=grow(self.input_ids, pad_token_id, left, right),
            attention_mask=grow(self.attention_mask, 0, left, right),
            position_ids=grow(self.position_ids, 0, left, right),
            response_mask=grow(self.response_mask, 0, 0, right),
            train=train,
            multi_modal=_pad_rows(self.multi_modal, extra),
            routes=None if self.routes is None else grow(self.routes, 0, left, right),
        )

    def left_aligned(self) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids and position_ids [B, T] with each row rolled left so that its first real token is at column 0.

        A row is [left padding | prompt | response | right padding] and its real tokens are contiguous, so after the
        roll every real token sits left of every padding token and the plain causal mask alone is exact: no real
        token can see padding. That is what transformer-engine and flash attention implement (a `causal` mask type
        ignores any padding mask passed in), and it spares the [b, s, s] padding mask of megatron's local attention.
        """
        t = self.seq_len
        shift = (self.prompt_len - self.prompt_lengths()).to(torch.long)  # [B] left-padding columns
        idx = (torch.arange(t, device=shift.device).unsqueeze(0) + shift.unsqueeze(1)) % t  # [B, T]
        return self.input_ids.gather(1, idx), self.position_ids.gather(1, idx)

    def prompt_lengths(self) -> torch.Tensor:
        """[B] real prompt tokens per row (prompts are left-padded)."""
        return self.attention_mask[:, : self.prompt_len].sum(-1)

    def response_lengths(self) -> torch.Tensor:
        """[B] columns up to each row's last real response token (responses are right-padded)."""
        m = self.attention_mask[:, self.prompt_len:].bool() | self.response_mask.bool()
        cols = torch.arange(1, self.response_len + 1, device=m.device).expand_as(m)
        return torch.where(m, cols, torch.zeros_like(cols)).amax(-1)

    def to(self, device: Union[str, torch.device]) -> "ModelBatch":
        return replace(
            self,
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            position_ids=self.position_ids.to(device),
            response_mask=self.response_mask.to(device),
            train=None if self.train is None else self.train.to(device),
            routes=None if self.routes is None else self.routes.to(device),
        )

    @classmethod
    def from_token_lists(
        cls,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        pad_token_id: int,
        train: Optional[TrainInputs] = None,
    ) -> "ModelBatch":
        """Left-pad prompts and right-pad responses into one batch; positions count real tokens from 0."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses; give one response per prompt")
        b = len(prompts)
        p = max((len(x) for x in prompts), default=0)
        # at least one response column (padding, masked): a step whose every response is empty (agents that never
        # called) still has the [B, R] shapes every phase indexes
        r = max(max((len(x) for x in responses), default=0), 1)
        ids = torch.full((b, p + r), pad_token_id, dtype=torch.long)
        attn = torch.zeros((b, p + r), dtype=torch.long)
        for i, (pr, rs) in enumerate(zip(prompts, responses)):
            ids[i, p - len(pr): p] = torch.as_tensor(list(pr), dtype=torch.long)
            ids[i, p: p + len(rs)] = torch.as_tensor(list(rs), dtype=torch.long)
            attn[i, p - len(pr): p + len(rs)] = 1
        pos = (attn.cumsum(-1) - 1).clamp_min(0)
        return cls(ids, attn, pos, attn[:, p:].clone(), train)
