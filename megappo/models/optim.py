"""Megatron DDP wrapping, megatron's optimizer and the learning-rate schedule, from plain settings.

- `wrap_ddp`: each model chunk in megatron's `DistributedDataParallel` (contiguous grad buffers, one reduce over
  the data-parallel group per step; the reduce overlaps backward on NCCL, never on gloo where it would only
  serialise).
- `build_optimizer`: `get_megatron_optimizer` with Adam (decoupled weight decay), gradient clipping and optionally
  the distributed optimizer (optimizer state sharded over data-parallel ranks).
- `build_scheduler`: megatron's `OptimizerParamScheduler`, constant or cosine after a linear warmup.

Inputs are `OptimSettings` (plain numbers), so callers map their own config onto it; megappo's config tree is
mapped in `megappo.trainer.settings.optim_settings`.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn

from megappo.platform.device import Platform

__all__ = ["OptimSettings", "wrap_ddp", "build_optimizer", "build_scheduler", "optimizer_step_context",
           "finite_step", "release_grad_buffers", "gradients_allocated", "grad_buffers_released"]


@dataclass
class OptimSettings:
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    clip_grad: float = 1.0  # global grad-norm clip; <= 0 disables clipping (the norm is still returned)
    total_steps: int = 1  # optimizer steps of the whole run (the cosine decay length)
    lr_warmup_steps: Optional[int] = None  # None or <= 0: use lr_warmup_steps_ratio
    lr_warmup_steps_ratio: float = 0.0
    lr_scheduler: str = "constant"  # "constant" or "cosine" (after warmup)
    min_lr_ratio: float = 0.0  # cosine: final lr = lr * min_lr_ratio
    use_distributed_optimizer: bool = False  # shard optimizer state over data-parallel ranks
    grad_reduce_in_fp32: bool = True  # reduce (and keep) gradients in fp32 when training in bf16/fp16

    def warmup_steps(self) -> int:
        if self.lr_warmup_steps is not None and self.lr_warmup_steps > 0:
            return int(self.lr_warmup_steps)
        return int(self.lr_warmup_steps_ratio * self.total_steps)

    def validate(self) -> None:
        if self.lr_scheduler not in ("constant", "cosine"):
            raise ValueError(f"optim.lr_scheduler={self.lr_scheduler!r}; use 'constant' or 'cosine'")
        if self.total_steps < 1:
            raise ValueError(f"total_steps={self.total_steps}: the schedule needs the number of optimizer steps >= 1")
        if not 0.0 <= self.lr_warmup_steps_ratio < 1.0:
            raise ValueError(f"optim.lr_warmup_steps_ratio={self.lr_warmup_steps_ratio} must be in [0, 1)")
        if self.warmup_steps() > 0 and self.warmup_steps() >= self.total_steps:
            raise ValueError(f"lr warmup of {self.warmup_steps()} steps does not fit in {self.total_steps} total "
                             "steps; lower optim.lr_warmup_steps(_ratio)")


def optimizer_step_context(platform: Optional[Platform]):
    """The context megatron's optimizer code runs in: on CPU, `cpu_compat.cuda_to_cpu()` (its hard-coded CUDA
    allocations and `param.type()` checks); on GPU, nothing. platform None: CPU unless CUDA is available."""
    import contextlib

    if platform.is_cuda if platform is not None else torch.cuda.is_available():
        return contextlib.nullcontext()
    from megappo.platform.cpu_compat import cuda_to_cpu

    return cuda_to_cpu()


def wrap_ddp(model_chunks: Sequence[nn.Module], settings: OptimSettings, platform: Platform,
             pg_collection: Any = None) -> list[nn.Module]:
    """Wrap each chunk in megatron's DistributedDataParallel (grad buffers reduced over the DP group).

    Only the first chunk buckets gradients (megatron's convention for virtual pipeline stages: later chunks finish
    backward first, so their buffers are reduced as one).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=settings.grad_reduce_in_fp32,
        # Overlap needs asynchronous collectives on a separate stream: NCCL. On gloo it only adds hooks.
        overlap_grad_reduce=platform.is_cuda,
        use_distributed_optimizer=settings.use_distributed_optimizer,
        check_for_nan_in_grad=False,
    )
    wrapped = []
    with optimizer_step_context(platform):
        for i, chunk in enumerate(model_chunks):
            wrapped.append(DistributedDataParallel(
                config=chunk.config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0,
                pg_collection=pg_collection,
            ))
    for w, chunk in zip(wrapped, model_chunks):  # keep the builder's metadata reachable on the wrapper
        for attr in ("megappo_config", "megappo_spec", "megappo_role"):
            if hasattr(chunk, attr):
                setattr(w, attr, getattr(chunk, attr))
    return wrapped


def release_grad_buffers(ddp_chunks: Sequence[nn.Module]) -> None:
    """Free the DDP chunks' gradient buffers (megatron's `offload_grad_buffers`: the storage goes, the views stay).
    Gradients live only inside an update (`compute.train_step` zeroes them first), so between a role's updates
    their 4 bytes per parameter (fp32) serve nothing: during the actor's update the critic's are gone, and the other
    way round. `gradients_allocated` brings them back."""
    with _typed_storage_quiet():
        for chunk in ddp_chunks:
            if hasattr(chunk, "offload_grad_buffers"):
                chunk.offload_grad_buffers(synchronize=False, empty_cache=False)


def grad_buffers_released(ddp_chunks: Sequence[nn.Module]) -> bool:
    """Whether any of the chunks' gradient buffers is released (`release_grad_buffers`): writing a gradient into
    one then would write into freed memory."""
    with _typed_storage_quiet():
        return any(b.grad_data is not None and b.grad_data.storage().size() == 0 and b.grad_data.numel() > 0
                   for c in ddp_chunks for b in getattr(c, "buffers", []) + getattr(c, "expert_parallel_buffers", []))


@contextlib.contextmanager
def _typed_storage_quiet():
    """megatron's buffers resize through `Tensor.storage()`, which warns that TypedStorage is deprecated."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)
        yield


class gradients_allocated:  # noqa: N801 - used as a context manager, like torch.no_grad
    """The DDP chunks' gradient buffers allocated (zeroed) inside, released after (`release_grad_buffers`), also
    when the update raises. Buffers that were never released are left as they are on entry."""

    def __init__(self, ddp_chunks: Sequence[nn.Module]):
        self.chunks = list(ddp_chunks)

    def __enter__(self) -> None:
        with _typed_storage_quiet():
            for chunk in self.chunks:
                if hasattr(chunk, "restore_grad_buffers"):
                    chunk.restore_grad_buffers(synchronize=False)

    def __exit__(self, *exc: Any) -> None:
        release_grad_buffers(self.chunks)


def build_optimizer(ddp_chunks: Sequence[nn.Module], settings: OptimSettings, platform: Platform,
                    dtype: Optional[torch.dtype] = None):
    """Megatron's Adam over the DDP-wrapped chunks: fp32 master weights for bf16/fp16 models, clipping by
    `settings.clip_grad`, the distributed optimizer when `settings.use_distributed_optimizer`."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    settings.validate()
    dtype = dtype or platform.dtype
    cfg = OptimizerConfig(
        optimizer="adam",
        lr=settings.lr,
        min_lr=settings.lr * settings.min_lr_ratio,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.betas[0],
        adam_beta2=settings.betas[1],
        adam_eps=settings.eps,
        # megatron only computes the norm when clipping; an infinite threshold keeps the norm and never clips
        clip_grad=settings.clip_grad if settings.clip_grad > 0 else float("inf"),
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=settings.use_distributed_optimizer,
    )
    with optimizer_step_context(platform):
        return get_megatron_optimizer(cfg, list(ddp_chunks), use_gloo_process_groups=not platform.is_cuda)


def build_scheduler(optimizer: Any, settings: OptimSettings):
    """Megatron's OptimizerParamScheduler: linear warmup from 0 to lr over the warmup steps, then constant or
    cosine decay to lr * min_lr_ratio at `total_steps`. Call `.step(1)` after each optimizer step;
    `state_dict()` / `load_state_dict()` checkpoint it."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    settings.validate()
    warmup = settings.warmup_steps()
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup > 0 else settings.lr,
        max_lr=settings.lr,
        min_lr=settings.lr * settings.min_lr_ratio,
        lr_warmup_steps=warmup,
        lr_decay_steps=max(settings.total_steps, warmup + 1),
        lr_decay_style=settings.lr_scheduler,
        start_wd=settings.weight_decay,
        end_wd=settings.weight_decay,
        wd_incr_steps=max(settings.total_steps, 1),
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=True,
        override_opt_param_scheduler=False,
    )


def finite_step(optimizer: Any) -> tuple[bool, float]:
    """`optimizer.step()` that never applies a non-finite gradient: (update applied, global grad norm).

    megatron's optimizer skips a step only when fp16's loss scaler finds an overflow; in fp32 and bf16 it applies NaN
    or Inf gradients, which wrecks the weights for good. Here the global gradient norm (reduced over every rank that
    holds gradients, so all ranks agree) is checked first, and a non-finite one skips the update on every rank.
    Call inside `optimizer_step_context`.
    """
    if not getattr(optimizer.config, "fp16", False):  # fp16's scaler checks for itself (and unscales only once)
        found_inf = optimizer.prepare_grads()
        norm = float(optimizer.get_grad_norm())
        if found_inf or not math.isfinite(norm):
            return False, norm
    applied, norm, _ = optimizer.step()
    return bool(applied), float(norm) if norm is not None else float("nan")
