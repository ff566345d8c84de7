"""Optimizer state in checkpoints: megatron-core 0.16's torch-Adam path, including the optimizer that has never
stepped.

A never-stepped Adam has no per-parameter state at all (torch creates `step`, `exp_avg` and `exp_avg_sq` on the first
step). Its sharded state dict has no tensors, while a loading optimizer always asks for them (megatron fills a fresh
one with placeholders first), so a checkpoint written before the first update cannot be loaded through megatron
(`Different dict keys encountered in apply_factory_merges`). Filling the state before the save is no way out: the
placeholder step changes the parameters under weight decay and Adam's bias correction. Such a checkpoint therefore
records the optimizer as *fresh*, and loading it puts the optimizer back to never-stepped: no Adam state, main
parameters copied from the loaded weights, the loss scaler's state as saved. That is exactly what the uninterrupted
run had at that point: the trainer's step-0 checkpoint (the KL guard's rollback target), a save after updates that
were all skipped (non-finite gradients), an actor saved during `trainer.critic_warmup`.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.distributed as dist

from megappo.models.checkpoint_errors import CheckpointError
from megappo.parallel import reduce_over_ranks

__all__ = ["is_fresh", "fresh_state", "reset_to_fresh", "ensure_state", "load_state"]


def _parts(optimizer: Any) -> Iterator[Any]:
    """The megatron optimizers inside `optimizer` (a ChainedOptimizer holds one per parameter kind)."""
    yield from getattr(optimizer, "chained_optimizers", None) or [optimizer]


def is_fresh(optimizer: Any) -> bool:
    """True when no part of `optimizer` has per-parameter state on any rank (it has never applied an update).
    Collective: ranks whose parameters never stepped must not save a different structure than those that did."""
    local = all(len(getattr(getattr(opt, "optimizer", None), "state", {}) or {}) == 0 for opt in _parts(optimizer))
    return reduce_over_ranks([1.0 if local else 0.0], dist.ReduceOp.MIN)[0] == 1.0


def fresh_state(optimizer: Any) -> list:
    """What a never-stepped optimizer still carries, per part: the fp16 loss scaler's state (a skipped update halves
    the scale), else None. Plain objects: saved in the checkpoint's common part."""
    return [opt.grad_scaler.state_dict() if getattr(opt, "grad_scaler", None) is not None else None
            for opt in _parts(optimizer)]


def reset_to_fresh(optimizer: Any, saved: Any) -> None:
    """Return `optimizer` to the never-stepped state of a checkpoint saved with `fresh_state` (`saved`, None for
    none), after the model's weights were loaded: Adam's state dropped, main parameters (the fp32 copies of bf16
    weights) taken from the loaded weights."""
    from megappo.models.optim import optimizer_step_context

    parts = list(_parts(optimizer))
    saved = saved if isinstance(saved, list) and len(saved) == len(parts) else [None] * len(parts)
    with optimizer_step_context(None):
        for opt, scaler in zip(parts, saved):
            inner = getattr(opt, "optimizer", None)
            if inner is not None:
                inner.state.clear()
            opt.reload_model_params()
            if scaler is not None and getattr(opt, "grad_scaler", None) is not None:
                opt.grad_scaler.load_state_dict(scaler)


def ensure_state(optimizer: Any) -> None:
    """Give a fresh DistributedOptimizer its Adam state before loading a saved state into it.

    megatron-core 0.16's DistributedOptimizer.state_dict() without Apex/TE reads each param's "step" and asserts
    there is one; a never-stepped torch Adam has none. megatron's own dummy initialisation (a zero-gradient step)
    creates the tensors that the load then overwrites in place.
    """
    for opt in _parts(optimizer):
        init = getattr(opt, "_init_optimizer_states_with_dummy_values", None)
        inner = getattr(opt, "optimizer", None)
        if init is not None and inner is not None and len(inner.state) == 0:
            init()


def load_state(optimizer: Any, state: Any) -> None:
    """`optimizer.load_state_dict(state)`, working around two megatron-core 0.16 bugs of the torch-Adam path.

    1. megatron-core 0.16's DistributedOptimizer without Apex/TE keeps torch Adam's per-parameter "step" in the
    optimizer state, restores it from the param groups, but `_set_main_param_and_optimizer_states` then copies every
    state key from the loaded per-parameter tensors, which never contain "step" (KeyError). For the duration of the
    load, each DistributedOptimizer instance copies only the keys the checkpoint has.
    2. See below: the restored "step" tensor is shared by all parameters.
    """
    patched = []
    for opt in _parts(optimizer):
        original = getattr(opt, "_set_main_param_and_optimizer_states", None)
        if original is None or not hasattr(opt, "_get_main_param_and_optimizer_states"):
            continue

        def set_states(model_param, tensors, _opt=opt, _original=original):
            if "step" in tensors:
                return _original(model_param, tensors)
            dst = _opt._get_main_param_and_optimizer_states(model_param)
            missing = [k for k in tensors if k not in dst]
            if missing:
                raise CheckpointError(f"optimizer state keys {missing} of the checkpoint are unknown to this optimizer")
            for key, value in tensors.items():
                dst[key].copy_(value)

        opt._set_main_param_and_optimizer_states = set_states
        patched.append(opt)
    try:
        optimizer.load_state_dict(state)
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states  # back to the class method
    # The same load assigns ONE "step" tensor object to every parameter's state; torch Adam increments each
    # parameter's step in place, so a shared tensor would advance once per parameter per step and skew Adam's bias
    # correction. Give each parameter its own copy.
    for opt in _parts(optimizer):
        inner = getattr(opt, "optimizer", None)
        for param_state in getattr(inner, "state", {}).values():
            if torch.is_tensor(param_state.get("step")):
                param_state["step"] = param_state["step"].clone()
