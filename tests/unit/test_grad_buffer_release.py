"""Gradient buffers exist only inside a role's update (`models.optim.gradients_allocated`): between updates they
hold no memory, and updates with the buffers released and re-allocated between them give the weights that updates
with the buffers kept give, bit for bit. Also glibc's mmap threshold that the CPU platform fixes (cpu_compat item 7)."""
from __future__ import annotations

import torch

from megappo.testing.dist import run_distributed


def _updates_job(rank, world_size, hf_dir):
    from megappo.kinds.build import build_model
    from megappo.kinds.weights import load_hf_weights
    from megappo.models.batch import ModelBatch, TrainInputs
    from megappo.models.compute import MicroBatching, train_step
    from megappo.models.optim import (OptimSettings, build_optimizer, build_scheduler, gradients_allocated,
                                      release_grad_buffers, wrap_ddp)
    from megappo.parallel import destroy_parallel, init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.cpu_compat import fix_malloc_mmap_threshold
    from megappo.platform.layout import ParallelLayout

    torch.set_num_threads(1)
    plat = detect_platform()
    ps = init_parallel(ParallelLayout(), plat, seed=0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (4, 12), generator=g)
    batch = ModelBatch.from_token_lists(ids[:, :5].tolist(), ids[:, 5:].tolist(), pad_token_id=0)
    batch.train = TrainInputs(old_log_probs=torch.full((4, 7), -5.0), advantages=torch.randn(4, 7, generator=g))

    def loss_fn(out, ctx):
        ratio = torch.exp(out.log_probs - ctx.batch.train.old_log_probs)
        return -(ratio * ctx.batch.train.advantages * ctx.batch.response_mask).sum() / ctx.global_num_tokens, {}

    def run(release: bool):
        chunks = build_model(hf_dir, "actor", ps, plat, seed=0)
        load_hf_weights(chunks, hf_dir, ps)
        settings = OptimSettings(lr=1e-3, total_steps=10)
        ddp = wrap_ddp(chunks, settings, plat)
        opt = build_optimizer(ddp, settings, plat)
        sched = build_scheduler(opt, settings)
        held = []
        if release:
            release_grad_buffers(ddp)
        for _ in range(3):
            if release:
                with gradients_allocated(ddp):
                    train_step(ddp, opt, sched, batch, loss_fn, parallel_state=ps, micro=MicroBatching(),
                               platform=plat)
            else:
                train_step(ddp, opt, sched, batch, loss_fn, parallel_state=ps, micro=MicroBatching(), platform=plat)
            held.append(sum(b.grad_data.untyped_storage().nbytes() for c in ddp for b in c.buffers))
        return [p.detach().clone() for c in ddp for p in c.parameters()], held

    kept, kept_bytes = run(release=False)
    released, released_bytes = run(release=True)
    out = {"equal": all(torch.equal(a, b) for a, b in zip(kept, released)), "kept_bytes": kept_bytes,
           "released_bytes": released_bytes,
           "threshold": fix_malloc_mmap_threshold()}
    destroy_parallel()
    return out


def test_released_gradients_hold_nothing_between_updates_and_change_no_weight(hf_model_dir):
    (out,) = run_distributed(_updates_job, 1, hf_model_dir("qwen2"), timeout=180)
    assert out["equal"]
    assert all(b > 0 for b in out["kept_bytes"]) and out["released_bytes"] == [0, 0, 0]
    assert out["threshold"] == 4 << 20  # Linux/glibc CI: large blocks are mapped and go back when freed
