"""A non-finite gradient never reaches the weights: megatron's optimizer would apply NaN in fp32/bf16. With two
data-parallel ranks and a NaN loss on one of them only, both skip the update (they agree through the reduced grad
norm), the weights stay bit-identical, and the next finite step updates normally."""
from __future__ import annotations

import pytest
import torch

from megappo.testing.dist import run_distributed

pytestmark = pytest.mark.multirank


def _job(rank, world_size, hf_dir):
    from megappo.kinds.build import build_model
    from megappo.kinds.weights import load_hf_weights
    from megappo.models.batch import ModelBatch
    from megappo.models.compute import MicroBatching, train_step
    from megappo.models.optim import OptimSettings, build_optimizer, build_scheduler, wrap_ddp
    from megappo.parallel import destroy_parallel, init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout

    torch.set_num_threads(1)
    plat = detect_platform()
    ps = init_parallel(ParallelLayout(), plat, seed=0)
    chunks = build_model(hf_dir, "actor", ps, plat, seed=1)
    load_hf_weights(chunks, hf_dir, ps)
    settings = OptimSettings(lr=1e-3, total_steps=4)
    ddp = wrap_ddp(chunks, settings, plat)
    opt = build_optimizer(ddp, settings, plat)
    sched = build_scheduler(opt, settings)
    batch = ModelBatch.from_token_lists([[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]], pad_token_id=0)

    def loss_fn(poison):
        def fn(out, ctx):
            loss = -(out.log_probs * ctx.batch.response_mask).sum() / ctx.global_num_tokens
            return (loss * float("nan") if poison else loss), {}
        return fn

    params = [p for c in ddp for p in c.parameters()]
    before = [p.detach().clone() for p in params]
    bad = train_step(ddp, opt, sched, batch, loss_fn(poison=rank == 1), parallel_state=ps, micro=MicroBatching(),
                     platform=plat)
    unchanged = all(torch.equal(p, b) for p, b in zip(params, before))
    good = train_step(ddp, opt, sched, batch, loss_fn(poison=False), parallel_state=ps, micro=MicroBatching(),
                      platform=plat)
    moved = any(not torch.equal(p, b) for p, b in zip(params, before))
    finite = all(bool(torch.isfinite(p).all()) for p in params)
    destroy_parallel()
    return bad.update_successful, bad.grad_norm, unchanged, good.update_successful, good.grad_norm, moved, finite


def test_a_nan_gradient_on_one_rank_is_skipped_on_every_rank(hf_model_dir):
    for ok, norm, unchanged, good_ok, good_norm, moved, finite in run_distributed(_job, 2, hf_model_dir("qwen2"),
                                                                                 timeout=240):
        assert not ok and norm != norm and unchanged  # skipped, NaN norm reported, weights untouched
        assert good_ok and good_norm == good_norm and good_norm > 0 and moved and finite
