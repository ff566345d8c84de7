"""Log-probs, values and training steps of megatron models, through megatron's own pipeline schedules.

Everything runs as megatron does it: a `forward_step(data_iterator, model) -> (output, loss_func)` driven by
`get_forward_backward_func()` over micro-batches, so any TP / PP / VPP / EP layout works unchanged. The last
pipeline stage turns its output into per-token results (vocab-parallel log-probs and entropy for the actor and
reference, per-token values for the critic); those are then broadcast over the pipeline group so every rank
returns the same tensors.

Layouts (`megappo.models.layout.plan`). The plan lays out each micro-batch once: padded rows, one pack of its sequences
(`MicroBatching(packed=True)`, verl's use_remove_padding) or this context-parallel rank's chunks. The forward step
gives the model the layout's inputs and the loss closures read the response window through the layout, so
everything after it (log-probs, entropy, values, the loss closures) sees the same [b, r] tensors in every layout.

Vision-language models (`VLMModel`): a micro-batch's rows bring their images (`ModelBatch.multi_modal`); the
forward step gives the model its own inputs beside the layout's, which the model hands out itself
(`micro_batch_inputs(mb, layout)`, see `megappo.kinds.qwen2_vl.inputs`: the images concatenated in row order,
per-sequence multimodal rotary positions, padded [3, b, s] or packed [3, 1, T], and the prompts' image-token mask).
Everything after the model's output is the text path's.

Loss scaling. A loss closure returns its micro-batch's *share* of the mini-batch loss, normalised by the global
counts it is given (response tokens and sequences over the whole data-parallel mini-batch), so that the plain sum
over micro-batches and data-parallel ranks is the mini-batch loss. Megatron's schedule divides each micro-batch
loss by the number of micro-batches and megatron's DDP averages gradients over data-parallel ranks;
`layout.plan.gradient_undo` multiplies both back, so the gradient is exactly that of the mini-batch loss however
the batch was split.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from megappo.data.multimodal import refuse_images
from megappo.models import router_replay
from megappo.models.batch import ModelBatch
from megappo.models.builder import unwrap
from megappo.models.layout.plan import Layout, gradient_undo, model_device, plan_micro_batches
from megappo.models.microbatch import MicroBatching, MicroBatchPlan
from megappo.models.topk import vocab_parallel_log_probs_at, vocab_parallel_topk
from megappo.models.vocab_parallel import vocab_parallel_token_stats
from megappo.parallel import ParallelState

__all__ = [
    "ModelOutputs", "MicroBatchContext", "StepMetrics", "MicroBatching", "LossFn",
    "compute_log_probs", "compute_topk_log_probs", "compute_values", "train_step",
]


@dataclass
class ModelOutputs:
    """Per-token outputs of one micro-batch, aligned with its response tokens."""

    log_probs: Optional[torch.Tensor] = None  # [b, r] log p(response token | prefix), actor/ref
    entropy: Optional[torch.Tensor] = None  # [b, r] entropy of the next-token distribution, when asked
    values: Optional[torch.Tensor] = None  # [b, r] critic value of the state before each response token
    sum_pi_squared: Optional[torch.Tensor] = None  # [b, r] sum over the vocabulary of p^2, forward-only, when asked
    # top-k distillation: a teacher's k most likely tokens [b, r, k] (forward-only, when asked) and their log-probs;
    # in a student's training step, the student's log-probs [b, r, k] of its batch's train.teacher_topk_ids
    topk_log_probs: Optional[torch.Tensor] = None
    topk_ids: Optional[torch.Tensor] = None


@dataclass
class MicroBatchContext:
    """What a loss closure needs besides the outputs: the micro-batch and the mini-batch's global counts."""

    batch: ModelBatch  # the micro-batch (train inputs included), cropped to its own padding
    global_num_tokens: int  # response tokens (response_mask) in the mini-batch over all data-parallel ranks
    global_num_seqs: int  # sequences in the mini-batch over all data-parallel ranks
    index: int  # position of this micro-batch in the step
    num_micro_batches: int


# loss_fn(outputs, ctx) -> (this micro-batch's share of the mini-batch loss, {metric name: scalar tensor})
LossFn = Callable[[ModelOutputs, MicroBatchContext], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass
class StepMetrics:
    loss: float  # the mini-batch loss: sum of the closures' losses over micro-batches and data-parallel ranks
    grad_norm: float  # global gradient norm before clipping
    lr: float  # learning rate used by this step
    update_successful: bool  # False when a non-finite gradient (or an fp16 overflow) skipped the update
    num_micro_batches: int
    metrics: dict[str, float] = field(default_factory=dict)  # closure metrics: shares summed over micro-batches and DP


def _response_window(mb: ModelBatch) -> torch.Tensor:
    """[b, R] left-aligned columns whose outputs score response tokens 0..R-1 (a row's last prompt token and on).

    An all-padding row (appended by `ModelBatch.pad_to`) reads columns 0..R-1; its outputs are masked anyway.
    """
    start = (mb.prompt_lengths().to(torch.long) - 1).clamp_(min=0)  # [b]
    return start.unsqueeze(1) + torch.arange(mb.response_len, device=start.device).unsqueeze(0)


def _is_value_model(model_chunks: Sequence[nn.Module]) -> bool:
    return getattr(unwrap(model_chunks[0]), "megappo_role", "actor") in ("critic", "reward")


def _real_vocab_size(model_chunks: Sequence[nn.Module]) -> Optional[int]:
    spec = getattr(unwrap(model_chunks[-1]), "megappo_spec", None)
    return getattr(spec, "vocab_size", None)


def _response_outputs(output: torch.Tensor, mb: ModelBatch, layout: Layout, *, value_model: bool,
                      calculate_entropy: bool, temperature: float, tp_group: Any, vocab_size: Optional[int],
                      sum_pi_squared: bool = False, topk: int = 0) -> ModelOutputs:
    """The last stage's output (logits [.., V/tp] or values, in the micro-batch's `layout`) -> per-response-token
    outputs [b, r].

    Response token j (column P + j) is predicted from column P + j - 1, so both log-probs and the critic's values
    (the value of the state before token j) are read from columns P-1 .. P+R-2: in the left-aligned rows the model
    ran on, each row's last prompt token and the R - 1 columns after it; the layout reads them wherever it put
    them. sum_pi_squared: also sum_v p_v^2 (no gradient). topk: also the k most likely tokens and their log-probs
    (no gradient); a batch with train.teacher_topk_ids also gets its log-probs of those tokens (with gradient).
    """
    if mb.prompt_len < 1:
        raise ValueError("every batch needs at least one prompt column: the first response token is scored from it")
    window = _response_window(mb)  # the model ran on left-aligned rows (see `ModelBatch.left_aligned`)
    if value_model:
        return ModelOutputs(values=layout.values(output, window).float())
    if not temperature > 0:
        raise ValueError(f"temperature={temperature}: log-probs need a positive temperature; a greedy rollout's "
                         "log-probs are under temperature 1 (use SamplingParams.logprob_temperature)")

    at_ids = mb.train.teacher_topk_ids if mb.train is not None else None

    def stats(logits: torch.Tensor, targets: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        if temperature != 1.0:
            logits = logits / temperature
        out = vocab_parallel_token_stats(logits, targets, tp_group, calculate_entropy=calculate_entropy,
                                         calculate_sum_pi_squared=sum_pi_squared, vocab_size=vocab_size)
        if topk:
            return (*out, *vocab_parallel_topk(logits, topk, tp_group, vocab_size=vocab_size))
        if at_ids is not None:
            return (*out, vocab_parallel_log_probs_at(logits, at_ids.long(), tp_group, vocab_size=vocab_size), None)
        return (*out, None, None)

    logp, ent, sq, top_lp, top_ids = layout.token_stats(output, window, mb.input_ids[:, mb.prompt_len:], stats)
    return ModelOutputs(log_probs=logp, entropy=ent, sum_pi_squared=sq, topk_log_probs=top_lp, topk_ids=top_ids)


def _model_inputs(model: nn.Module, mb: ModelBatch, layout: Layout) -> dict[str, Any]:
    """The keyword arguments an (unwrapped) chunk takes beyond its layout's: those its own `micro_batch_inputs`
    gives (a vision-language model's images and positions); none for a text model, which refuses images."""
    own = getattr(model, "micro_batch_inputs", None)
    if own is not None:
        return own(mb, layout)
    refuse_images(mb.multi_modal)
    return {}


def _forward_step(data_iterator: Iterator[tuple[ModelBatch, Layout]], model: nn.Module, *,
                  loss_func: Callable) -> tuple:
    """Megatron's forward step: the next micro-batch and its layout -> (output, the loss closure on it)."""
    mb, layout = next(data_iterator)
    inputs = layout.inputs()
    inputs.update(_model_inputs(unwrap(model), mb, layout))
    router_replay.before_forward(model, mb, layout)  # a MoE model's routes replayed or recorded
    output = model(**inputs)
    router_replay.after_forward(model, mb)
    return output, partial(loss_func, mb, layout)


def _prepare(model_chunks: Sequence[nn.Module], parallel_state: ParallelState) -> Any:
    """Megatron's model config, set for our micro-batches."""
    from megatron.core.utils import get_model_config

    config = get_model_config(model_chunks[0])
    # Micro-batches are cropped to their own padding, so activation shapes differ between micro-batches: the
    # pipeline p2p exchanges shapes first (megatron's variable_seq_lengths). Not with virtual stages: there a
    # stage can send to its previous and next rank in one batched call, and when both are the same peer (PP=2)
    # gloo pairs the two shape messages crosswise. Those micro-batches are padded to one shape instead.
    config.variable_seq_lengths = parallel_state.pp_size > 1 and not parallel_state.vpp_size
    if parallel_state.vpp_size and not torch.cuda.is_available():
        # The same crosswise pairing hits batched tensor sends on gloo; megatron's unbatched path orders the
        # sends and receives by even/odd rank so that they pair up.
        config.batch_p2p_comm = False
    return config


def _run_schedule(model_chunks: Sequence[nn.Module], plan: MicroBatchPlan, loss_func: Callable, *,
                  parallel_state: ParallelState, forward_only: bool) -> list[dict]:
    """Run megatron's forward(-backward) schedule over the plan's micro-batches; the last stage's loss dicts."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    fbf = get_forward_backward_func(parallel_state.pp_size, parallel_state.vpp_size)
    n = len(plan)
    # One iterator per model chunk: with virtual pipeline stages every chunk walks the same micro-batches.
    iters = [iter(list(zip(plan.micro_batches, plan.layouts))) for _ in model_chunks]
    return fbf(
        forward_step_func=partial(_forward_step, loss_func=loss_func),
        data_iterator=iters if len(iters) > 1 else iters[0],
        model=list(model_chunks),
        num_microbatches=n,
        seq_length=max(layout.seq_length for layout in plan.layouts),
        micro_batch_size=max(layout.rows for layout in plan.layouts),
        forward_only=forward_only,
    )


def _broadcast_from_last_stage(tensors: list[Optional[torch.Tensor]], shapes: list[tuple[int, ...]],
                               parallel_state: ParallelState, device: torch.device) -> list[torch.Tensor]:
    """Send the last pipeline stage's tensors to every stage of `parallel_state.pp_group`."""
    if parallel_state.pp_size == 1:
        return tensors  # type: ignore[return-value]
    src = dist.get_global_rank(parallel_state.pp_group, parallel_state.pp_size - 1)
    out = []
    for t, shape in zip(tensors, shapes):
        if t is None:
            t = torch.empty(shape, dtype=torch.float32, device=device)
        t = t.contiguous()
        dist.broadcast(t, src=src, group=parallel_state.pp_group)
        out.append(t)
    return out


@contextlib.contextmanager
def _mode(model_chunks: Sequence[nn.Module], train: bool):
    before = [m.training for m in model_chunks]
    for m in model_chunks:
        m.train(train)
    try:
        yield
    finally:
        for m, t in zip(model_chunks, before):
            m.train(t)


def _forward_only(model_chunks, batch, parallel_state, micro, *, value_model, calculate_entropy, temperature,
                  sum_pi_squared=False, topk=0):
    _prepare(model_chunks, parallel_state)
    vocab_size = _real_vocab_size(model_chunks)
    plan = plan_micro_batches(model_chunks, batch, micro, parallel_state)

    def loss_func(mb: ModelBatch, layout: Layout, output: torch.Tensor):
        out = _response_outputs(output, mb, layout, value_model=value_model, calculate_entropy=calculate_entropy,
                                temperature=temperature, tp_group=parallel_state.tp_group, vocab_size=vocab_size,
                                sum_pi_squared=sum_pi_squared, topk=topk)
        return torch.zeros((), device=output.device), out

    with torch.no_grad(), _mode(model_chunks, train=False):
        results = _run_schedule(model_chunks, plan, loss_func, parallel_state=parallel_state, forward_only=True)
    router_replay.keep_recorded(model_chunks, plan, batch, parallel_state.pp_group)  # R2's first pass
    keys = ["values"] if value_model else (["log_probs"] + (["entropy"] if calculate_entropy else [])
                                           + (["sum_pi_squared"] if sum_pi_squared else [])
                                           + (["topk_log_probs", "topk_ids"] if topk else []))
    restored: list[Optional[torch.Tensor]] = [None] * len(keys)
    if parallel_state.is_pipeline_last_stage:  # ids travel as fp32: exact below 2^24, past any vocabulary
        restored = [plan.restore([getattr(o, k).float() for o in results]) for k in keys]
    shape = (batch.batch_size, batch.response_len)
    shapes = [shape + ((topk,) if k.startswith("topk") else ()) for k in keys]
    out = _broadcast_from_last_stage(restored, shapes, parallel_state, model_device(model_chunks))
    return [t.to(batch.input_ids.device) for t in out]  # results live where the batch came from


def compute_log_probs(
    model_chunks: Sequence[nn.Module],
    batch: ModelBatch,
    *,
    parallel_state: ParallelState,
    micro: MicroBatching = MicroBatching(),
    calculate_entropy: bool = False,
    temperature: float = 1.0,
    calculate_sum_pi_squared: bool = False,
) -> tuple[Optional[torch.Tensor], ...]:
    """Forward-only log p(response token) [B, R] (and entropy [B, R]) of an LM-head model; zero on padding.

    The logits stay vocab-parallel (each TP rank holds [b, s, V/tp]); results are identical on every rank of the
    model-parallel group. `temperature` divides the logits first (match the sampler's temperature).
    Returns (log_probs, entropy or None); with calculate_sum_pi_squared (verl's name: the optimal token
    baselines' input) (log_probs, entropy or None, sum_pi_squared [B, R]), sum_v p_v^2 of the same distribution.
    """
    out = _forward_only(model_chunks, batch, parallel_state, micro, value_model=False,
                        calculate_entropy=calculate_entropy, temperature=temperature,
                        sum_pi_squared=calculate_sum_pi_squared)
    mask = batch.response_mask.to(out[0].dtype)
    logp, ent = out[0] * mask, (out[1] * mask if calculate_entropy else None)
    return (logp, ent, out[-1] * mask) if calculate_sum_pi_squared else (logp, ent)


def compute_topk_log_probs(
    model_chunks: Sequence[nn.Module], batch: ModelBatch, k: int, *, parallel_state: ParallelState,
    micro: MicroBatching = MicroBatching(), temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward-only (log p(response token) [B, R], the k most likely tokens' log-probs [B, R, k] fp32 and their ids
    [B, R, k] long) at each response position of an LM-head model (a distillation teacher); zero on padding.
    Identical on every rank of the model-parallel group. Not with context parallelism (the layout refuses)."""
    logp, top_lp, top_ids = _forward_only(model_chunks, batch, parallel_state, micro, value_model=False,
                                          calculate_entropy=False, temperature=temperature, topk=k)
    mask = batch.response_mask.to(logp.dtype)
    return logp * mask, top_lp * mask.unsqueeze(-1), top_ids.long() * batch.response_mask.long().unsqueeze(-1)


def compute_values(
    model_chunks: Sequence[nn.Module],
    batch: ModelBatch,
    *,
    parallel_state: ParallelState,
    micro: MicroBatching = MicroBatching(),
) -> torch.Tensor:
    """Forward-only critic values [B, R]: the value of the state before each response token; zero on padding."""
    (values,) = _forward_only(model_chunks, batch, parallel_state, micro, value_model=True,
                              calculate_entropy=False, temperature=1.0)
    return values * batch.response_mask.to(values.dtype)


def _global_counts(batch: ModelBatch, dp_group: Any, device: torch.device) -> tuple[int, int]:
    t = torch.tensor([int(batch.response_mask.sum()), batch.batch_size], dtype=torch.long, device=device)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(t, group=dp_group)
    return int(t[0]), int(t[1])


def _reduce_metrics(results: list[dict], parallel_state: ParallelState) -> tuple[float, dict[str, float]]:
    """(loss, metrics), each summed over micro-batches and DP ranks, identical on every rank.

    A closure returns its micro-batch's *share* of each metric, as of the loss (e.g. a token mean weighted by the
    micro-batch's fraction of the mini-batch's tokens), so the sums are the mini-batch's values."""
    payload: list[Any] = [None, None]
    if parallel_state.is_pipeline_last_stage:
        keys = sorted(results[0])
        if any(sorted(r) != keys for r in results):
            names = [sorted(r) for r in results]
            raise ValueError(f"loss_fn returned different metric names across micro-batches: {names}")
        reduced = torch.stack([torch.stack([r[k].float().reshape(()) for r in results]) for k in keys]).sum(-1)
        if parallel_state.dp_size > 1:
            dist.all_reduce(reduced, group=parallel_state.dp_group)
        payload = [keys, reduced.tolist()]
    if parallel_state.pp_size > 1:
        src = dist.get_global_rank(parallel_state.pp_group, parallel_state.pp_size - 1)
        dist.broadcast_object_list(payload, src=src, group=parallel_state.pp_group)
    metrics = dict(zip(payload[0], payload[1]))
    return metrics.pop("loss"), metrics


def train_step(
    model_chunks: Sequence[nn.Module],
    optimizer: Any,
    scheduler: Any,
    batch: ModelBatch,
    loss_fn: LossFn,
    *,
    parallel_state: ParallelState,
    micro: MicroBatching = MicroBatching(),
    calculate_entropy: bool = False,
    temperature: float = 1.0,
    platform: Any = None,
) -> StepMetrics:
    """One optimizer step on `batch` (this data-parallel rank's share of the mini-batch).

    model_chunks: DDP-wrapped chunks (`optim.wrap_ddp`); optimizer/scheduler from `optim.build_optimizer` /
    `optim.build_scheduler` (scheduler may be None). platform: `detect_platform()`'s (None: CPU unless CUDA is
    available), for megatron's optimizer code on CPU. `loss_fn(outputs, ctx)` gets the micro-batch's log-probs
    (and entropy) for an LM model or values for a critic, each [b, r], and returns its share of the mini-batch
    loss (normalise by `ctx.global_num_tokens` / `ctx.global_num_seqs`) and its shares of scalar metrics (summed
    over micro-batches and data-parallel ranks, as the loss).
    """
    from megatron.core.distributed import finalize_model_grads

    from megappo.models.optim import finite_step, grad_buffers_released, gradients_allocated, optimizer_step_context

    if not all(hasattr(c, "zero_grad_buffer") for c in model_chunks):
        raise TypeError("train_step needs megatron-DDP-wrapped chunks: wrap them with megappo.models.optim.wrap_ddp")
    if grad_buffers_released(model_chunks):  # a caller outside the trainer's updates, which allocate them per update
        with gradients_allocated(model_chunks):
            return train_step(model_chunks, optimizer, scheduler, batch, loss_fn, parallel_state=parallel_state,
                              micro=micro, calculate_entropy=calculate_entropy, temperature=temperature,
                              platform=platform)
    config = _prepare(model_chunks, parallel_state)
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    no_sync = [c.no_sync for c in model_chunks if hasattr(c, "no_sync")]
    if no_sync and getattr(getattr(model_chunks[0], "ddp_config", None), "overlap_grad_reduce", False):
        config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        config.grad_sync_func = None
    value_model = _is_value_model(model_chunks)
    vocab_size = _real_vocab_size(model_chunks)

    plan = plan_micro_batches(model_chunks, batch, micro, parallel_state)
    n_tokens, n_seqs = _global_counts(batch, parallel_state.dp_group, model_device(model_chunks))
    n_tokens = max(n_tokens, 1)  # a mini-batch with no response token: shares of 0, not NaN
    n = len(plan)
    index_of = {id(mb): i for i, mb in enumerate(plan.micro_batches)}
    undo = gradient_undo(n, parallel_state)

    def loss_func(mb: ModelBatch, layout: Layout, output: torch.Tensor):
        out = _response_outputs(output, mb, layout, value_model=value_model, calculate_entropy=calculate_entropy,
                                temperature=temperature, tp_group=parallel_state.tp_group, vocab_size=vocab_size)
        ctx = MicroBatchContext(mb, n_tokens, n_seqs, index_of[id(mb)], n)
        loss, metrics = loss_fn(out, ctx)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ValueError(f"loss_fn must return a scalar tensor as its loss, got {type(loss).__name__} "
                             f"{tuple(getattr(loss, 'shape', ()))}")
        if "loss" in metrics:
            raise ValueError("loss_fn metrics must not use the key 'loss' (the step reports the loss itself)")
        # clone: the schedule divides the returned loss in place, and a detached view would share that storage
        reported = {"loss": loss.detach().clone(), **{k: v.detach().clone() for k, v in metrics.items()}}
        return loss * undo, reported

    for chunk in model_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    with _mode(model_chunks, train=True):
        results = _run_schedule(model_chunks, plan, loss_func, parallel_state=parallel_state, forward_only=False)
    lr = float(optimizer.param_groups[0]["lr"])
    with optimizer_step_context(platform):
        update_successful, grad_norm = finite_step(optimizer)
    if scheduler is not None and update_successful:
        scheduler.step(1)
    loss, metrics = _reduce_metrics(results, parallel_state)
    return StepMetrics(loss=loss, grad_norm=grad_norm, lr=lr, update_successful=update_successful,
                       num_micro_batches=n, metrics=metrics)

