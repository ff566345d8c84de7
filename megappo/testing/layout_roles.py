"""The actor and the critic of a tiny HF model in one parallel layout, for the tests that compare layouts (packing,
prefix sharing): each role built from the same weights, wrapped in megatron's DDP with a zero-lr optimizer (a step
leaves the weights as they were, so the next layout starts from the same), with its loss closure."""
from __future__ import annotations

from typing import Any, Iterator, NamedTuple

import torch


class LayoutRole(NamedTuple):
    role: str  # "actor" or "critic"
    ddp: Any  # the role's DDP-wrapped model chunks
    optimizer: Any
    loss_fn: Any  # the PPO actor loss (entropy bonus 0.01, no KL loss) or the critic's
    batch: Any  # this data-parallel rank's share of the batch
    ps: Any  # the layout's ParallelState
    platform: Any


def layout_roles(layout_kw: dict, hf_dir: str, full_batch) -> Iterator[LayoutRole]:
    """The actor, then the critic, of `hf_dir` in `layout_kw` (ParallelLayout's fields; `recompute: True` for full
    activation recompute) on this rank's rows of `full_batch`; the parallel state is destroyed after the last."""
    from megappo.kinds.build import build_model
    from megappo.kinds.weights import load_hf_weights
    from megappo.models.losses import ActorLossSettings, CriticLossSettings, actor_loss_fn, critic_loss_fn
    from megappo.models.optim import OptimSettings, build_optimizer, wrap_ddp
    from megappo.parallel import destroy_parallel, init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout

    torch.set_num_threads(1)
    layout_kw = dict(layout_kw)
    overrides = {}
    if layout_kw.pop("recompute", False):  # model.enable_gradient_checkpointing's megatron settings
        overrides = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    plat = detect_platform()
    ps = init_parallel(ParallelLayout(**layout_kw), plat, seed=0)
    try:
        batch = full_batch.select(torch.arange(full_batch.batch_size).chunk(ps.dp_size)[ps.dp_rank])
        settings = OptimSettings(lr=0.0, weight_decay=0.0, clip_grad=0.0, total_steps=4)
        for role in ("actor", "critic"):
            chunks = build_model(hf_dir, role, ps, plat, seed=3, config_overrides=overrides)
            load_hf_weights(chunks, hf_dir, ps)
            ddp = wrap_ddp(chunks, settings, plat)
            loss_fn = (actor_loss_fn(ActorLossSettings(entropy_coeff=0.01, use_kl_loss=False)) if role == "actor"
                       else critic_loss_fn(CriticLossSettings()))
            yield LayoutRole(role, ddp, build_optimizer(ddp, settings, plat), loss_fn, batch, ps, plat)
    finally:
        destroy_parallel()
