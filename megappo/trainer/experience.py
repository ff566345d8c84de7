"""A step's experience: the sampled responses of the whole step, and this rank's typed batch of them.

`Samples` holds every sample of the step (all data-parallel ranks' rollouts gathered, identical on every rank) as
token lists; `Experience` is this data-parallel rank's share, balanced by token workload, as tensors that the
phases fill in one after another (scores, reference and old log-probs, values, rewards, advantages).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Sequence

import torch

from megappo.data.dataset import PromptBatch
from megappo.data.multimodal import MultiModalInputs, batch_images
from megappo.models.batch import ModelBatch, TrainInputs
from megappo.models.router_replay import routes_from_json, routes_to_json
from megappo.data.multimodal import multi_modal_from_json, multi_modal_to_json
from megappo.rollout.sampling import Completion


@dataclass
class Samples:
    """Every sample of one step, in (prompt, sample) order: N = prompts * n."""

    prompt_ids: list[list[int]]  # N prompts, unpadded
    response_ids: list[list[int]]  # N responses, the stop token included when one ended it
    rollout_log_probs: list[list[float]]  # N, per response token, as the engine reported them
    truncated: list[bool]  # N, stopped by the length limit rather than a stop token
    uids: list[int]  # N, the prompt's index in the step: a GRPO group
    data_sources: list[str]  # N
    ground_truths: list[Any]  # N
    extra_infos: list[dict]  # N
    weight_versions: list[int]  # N, the version of the actor's weights that generated it (its first token's)
    dataset_indices: list[int]  # N, the prompt's position in the dataset (exactly-once accounting)
    partial: list[bool]  # N, generated across a weight sync (async_training.partial_rollout): tokens of 2 versions
    # N, multi-turn rollouts: 1 on the model's response tokens, 0 on tool answers and template tokens (None: all 1)
    loss_masks: list[Optional[list[int]]] = field(default_factory=list)
    turn_stats: list[Optional[dict]] = field(default_factory=list)  # N, multi-turn: the trajectory's stats
    tool_results: list[Optional[list[dict]]] = field(default_factory=list)  # N, multi-turn: each tool call's record
    # N, vision-language prompts: the prompt's images (the samples of a prompt share one object); None: text
    multi_modal: list[Optional[MultiModalInputs]] = field(default_factory=list)
    # N, per response token the weights' version that produced it (None: every token is weight_versions[i]'s)
    token_versions: list[Optional[list[int]]] = field(default_factory=list)
    # N, the text of the prompt's last user message in the dataset row (what a judge reads as the question; None:
    # not known, the decoded prompt is used)
    questions: list[Optional[str]] = field(default_factory=list)
    # N, MoE router replay R3: the engine's routes [P + R - 1, L, k] uint8/int16 (`Completion.routed_experts`)
    routed_experts: list[Optional[torch.Tensor]] = field(default_factory=list)
    # N, left out of training: a failed episode with rollout.agent.on_failure=drop (None: not dropped). Its loss
    # mask is all 0 and its reward is left out of reward/*
    dropped: list[Optional[bool]] = field(default_factory=list)

    def __post_init__(self) -> None:
        # the optional per-sample fields, when not given (or absent from a checkpoint's samples): None per sample
        for name in ("loss_masks", "turn_stats", "tool_results", "multi_modal", "token_versions", "questions",
                     "routed_experts", "dropped"):
            if len(getattr(self, name)) != len(self.response_ids):
                setattr(self, name, [None] * len(self.response_ids))
        # a checkpoint's samples (trainer_state.json) hold their images and routes in JSON form
        self.multi_modal = [multi_modal_from_json(m) for m in self.multi_modal]
        self.routed_experts = [routes_from_json(r) for r in self.routed_experts]

    @property
    def has_images(self) -> bool:
        return any(m is not None for m in self.multi_modal)

    def to_json(self) -> dict:
        """The samples as JSON-able lists (a checkpoint's `TrainState.ready`); `Samples(**d)` reads them back."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["multi_modal"] = [multi_modal_to_json(m) for m in self.multi_modal]
        out["routed_experts"] = [routes_to_json(r) for r in self.routed_experts]
        return out

    @property
    def multi_turn(self) -> bool:
        return any(m is not None for m in self.loss_masks)

    def __len__(self) -> int:
        return len(self.response_ids)

    def select(self, rows: list[int]) -> "Samples":
        return Samples(*[[getattr(self, f.name)[r] for r in rows] for f in fields(self)])

    @staticmethod
    def concat(parts: list["Samples"]) -> "Samples":
        return Samples(*[[x for p in parts for x in getattr(p, f.name)] for f in fields(Samples)])

    @classmethod
    def from_completions(cls, prompts: PromptBatch, completions: Sequence[Sequence[Completion]]) -> "Samples":
        """prompts: B prompts; completions: B lists of n completions (an engine's `generate` answer)."""
        out = cls(*[[] for _ in fields(cls)])
        images = getattr(prompts, "multi_modal", None) or [None] * len(completions)
        for b, group in enumerate(completions):
            ids = prompts.input_ids[b][prompts.attention_mask[b].bool()].tolist()
            for c in group:
                out.prompt_ids.append(c.extra.get("prompt_ids") or ids)  # an environment's own first messages
                out.response_ids.append(list(c.output_ids))
                out.rollout_log_probs.append(list(c.log_probs))
                out.truncated.append(c.finish_reason == "length")
                out.uids.append(b)
                out.data_sources.append(prompts.data_sources[b])
                out.ground_truths.append(prompts.ground_truths[b])
                turns = c.extra.get("multi_turn")
                out.extra_infos.append(prompts.extra_infos[b] if turns is None else {
                    **(prompts.extra_infos[b] or {}), "messages": c.extra.get("messages", []),
                    "tool_results": c.extra.get("tool_results", []), "num_turns": int(turns["turns"]),
                    "env_reward": float(c.extra.get("env_reward", 0.0))})
                out.weight_versions.append(int(c.weight_version))
                out.dataset_indices.append(int(prompts.indices[b]))
                out.partial.append(bool(c.extra.get("partial", False)))
                out.loss_masks.append(c.extra.get("loss_mask"))
                out.turn_stats.append(turns)
                out.tool_results.append(c.extra.get("tool_results") if turns is not None else None)
                out.multi_modal.append(images[b])
                versions = c.versions()
                out.token_versions.append(versions if len(set(versions)) > 1 else None)
                out.questions.append(_question(prompts.raw_prompts[b] if prompts.raw_prompts else None))
                out.routed_experts.append(c.routed_experts)
                out.dropped.append(None)
        return out

    def token_staleness(self, version: int) -> list[int]:
        """How many versions behind `version` each trained token (loss mask 1) of every sample is."""
        behind = []
        for i, response in enumerate(self.response_ids):
            versions = self.token_versions[i] or [self.weight_versions[i]] * len(response)
            mask = self.loss_masks[i] or [1] * len(response)
            behind += [version - v for v, m in zip(versions, mask) if m]
        return behind


def _question(messages: Optional[list[dict]]) -> Optional[str]:
    """The text of the last user message of a dataset row's prompt (its text parts, for a multimodal one)."""
    for m in reversed(messages or []):
        if m.get("role") == "user":
            content = m.get("content")
            if isinstance(content, str):
                return content
            return "".join(p.get("text", "") for p in content or [] if isinstance(p, dict)) or None
    return None


@dataclass
class Experience:
    """This data-parallel rank's B samples of the step. Tensors [B, R] are aligned with the response tokens."""

    batch: ModelBatch  # input_ids [B, P+R]; response_mask [B, R]; train inputs [B, R] filled by the phases
    indices: list[int]  # [B] each sample's index in the step's `Samples`
    uids: torch.Tensor  # [B] long, the prompt's index in the step (GRPO group)
    data_sources: list[str]  # [B]
    truncated: torch.Tensor  # [B] bool, the response hit the length limit
    dropped: torch.Tensor  # [B] bool, left out of training (Samples.dropped)
    rollout_log_probs: torch.Tensor  # [B, R] the engine's log-probs (0 on padding)
    scores: Optional[torch.Tensor] = None  # [B] the sequence score (rule reward or reward model)
    token_rewards: Optional[torch.Tensor] = None  # [B, R] score at the last token, minus the KL penalty if any
    baselines: Optional[torch.Tensor] = None  # [B] the score of the prompt's greedy response (ReMax)
    reward_components: Optional[torch.Tensor] = None  # [K, B] the reward function's algorithm.gdpo_reward_keys
    # [B, R] the old policy's sum over the vocabulary of pi^2 at each response token (estimators with
    # needs_sum_pi_squared: the optimal token baselines)
    sum_pi_squared: Optional[torch.Tensor] = None

    @property
    def train(self) -> TrainInputs:
        if self.batch.train is None:
            self.batch.train = TrainInputs()
        return self.batch.train

    @property
    def mask(self) -> torch.Tensor:
        return self.batch.response_mask

    def response_lengths(self) -> torch.Tensor:
        """[B] response tokens: the model's and, in multi-turn rollouts, the tool answers' too."""
        return self.batch.attention_mask[:, self.batch.prompt_len:].sum(-1)

    def last_scored_index(self) -> torch.Tensor:
        """[B] each response's last token the loss sees (where the sequence score goes); 0 for an empty one."""
        m = self.mask.bool()
        cols = torch.arange(m.shape[1], device=m.device).expand_as(m)
        return torch.where(m, cols, torch.zeros_like(cols)).amax(-1) if m.shape[1] else m.sum(-1)


def build_experience(samples: Samples, indices: Sequence[int], pad_token_id: int) -> Experience:
    """The typed batch of `samples[indices]` (prompts left-padded, responses right-padded)."""
    idx = list(indices)
    batch = ModelBatch.from_token_lists([samples.prompt_ids[i] for i in idx], [samples.response_ids[i] for i in idx],
                                        pad_token_id, train=None)
    batch.multi_modal = batch_images(samples.multi_modal, idx)
    logp = torch.zeros(batch.response_mask.shape, dtype=torch.float32)
    for row, i in enumerate(idx):
        lp = samples.rollout_log_probs[i]
        logp[row, :len(lp)] = torch.as_tensor(lp, dtype=torch.float32)
        loss_mask = samples.loss_masks[i]
        if loss_mask is not None:  # multi-turn: tool answers and template tokens are not trained on
            batch.response_mask[row, :len(loss_mask)] = torch.as_tensor(loss_mask, dtype=batch.response_mask.dtype)
    return Experience(
        batch=batch, indices=idx, uids=torch.as_tensor([samples.uids[i] for i in idx], dtype=torch.long),
        data_sources=[samples.data_sources[i] for i in idx],
        truncated=torch.as_tensor([samples.truncated[i] for i in idx], dtype=torch.bool),
        dropped=torch.as_tensor([bool(samples.dropped[i]) for i in idx], dtype=torch.bool),
        rollout_log_probs=logp,
    )


def balanced_partitions(workloads: Sequence[int], parts: int, groups: Optional[Sequence[int]] = None,
                        blocks: int = 1) -> list[list[int]]:
    """Split indices 0..N-1 into `parts` lists of equal size N / parts whose workloads are close.

    Longest-processing-time first: the heaviest remaining sample goes to the lightest part that still has room.
    Each part keeps its indices in ascending order, so a part's content does not depend on ties in the sort.
    `groups`: each sample's group (its prompt's uid); where the groups are of one size and split evenly over the
    parts, whole groups are balanced instead, so that a group's samples stay on one rank (prefix sharing runs
    their prompt once).
    `blocks`: the N samples are that many consecutive equal slices (a step's mini-batches), each balanced over the
    parts on its own, so a part's j-th of `blocks` equal slices is its share of the j-th block: balancing moves no
    sample into another mini-batch, and a data-parallel rank's j-th optimizer step trains its share of the samples
    one rank's j-th trains, whatever the number of ranks.
    """
    n = len(workloads)
    if n % (parts * blocks):
        raise ValueError(f"{n} samples do not split evenly over {parts} data-parallel ranks"
                         + (f" in each of {blocks} mini-batches" if blocks > 1 else ""))
    if blocks > 1:
        size = n // blocks
        split = [balanced_partitions(workloads[j * size:(j + 1) * size], parts,
                                     None if groups is None else groups[j * size:(j + 1) * size])
                 for j in range(blocks)]
        return [[j * size + i for j in range(blocks) for i in split[j][p]] for p in range(parts)]
    if groups is not None:
        members: dict[int, list[int]] = {}
        for i, g in enumerate(groups):
            members.setdefault(int(g), []).append(i)
        units = list(members.values())
        if len({len(u) for u in units}) == 1 and len(units) % parts == 0:
            split = balanced_partitions([sum(workloads[i] for i in u) for u in units], parts)
            return [sorted(i for u in part for i in units[u]) for part in split]
    size = n // parts
    heap = [(0, p) for p in range(parts)]  # (load, part)
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(n), key=lambda i: (-workloads[i], i)):
        load, p = heapq.heappop(heap)
        out[p].append(i)
        if len(out[p]) < size:
            heapq.heappush(heap, (load + workloads[i], p))
    return [sorted(p) for p in out]


def mini_batch_blocks(n: int, parts: int, *counts: int) -> int:
    """The slices `balanced_partitions` balances the step's `n` samples in, one by one: the finest that every
    role's mini-batches (`counts` per epoch) are made of. A balance over the whole step would move samples between
    mini-batches, so the optimizer steps would train other samples at DP2 than at one rank. Counts that do not
    divide the samples give 1 (the whole step), and `mini_batches` says what does not divide."""
    blocks = math.lcm(*counts)
    return blocks if n % (blocks * parts) == 0 else 1


def workloads(samples: Samples) -> list[int]:
    """Tokens each sample costs in the forward and backward passes (prompt + response)."""
    return [len(p) + len(r) for p, r in zip(samples.prompt_ids, samples.response_ids)]


def mini_batches(n: int, count: int, *, shuffle: bool, seed: int) -> list[torch.Tensor]:
    """`count` equal index sets over 0..n-1 (a seeded permutation when `shuffle`)."""
    if n % count:
        raise ValueError(f"{n} local samples do not split into {count} mini-batches")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)) if shuffle else torch.arange(n)
    return list(order.view(count, n // count))
