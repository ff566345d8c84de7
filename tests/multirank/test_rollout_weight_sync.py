"""Weight sync, rollout and training log-probs agree: a TP2xPP2 megatron actor streams its weights
(`iter_hf_weights`, buckets) into an in-process engine that started from *other* weights; the engine samples
responses, and megatron's `compute_log_probs` on those responses equals the engine's own log-probs (same
temperature). One test covers conversion, weight sync, sampling and the training-side log-prob path together.
"""
from __future__ import annotations

import pytest
import torch

from megappo.testing.dist import run_distributed

pytestmark = pytest.mark.multirank
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16], [17]]
TEMPERATURE = 0.8


def _job(rank, world_size, actor_dir, stale_dir):
    from megappo.kinds.build import build_model
    from megappo.kinds.weights import iter_hf_weights, load_hf_weights
    from megappo.models.batch import ModelBatch
    from megappo.models.compute import MicroBatching, compute_log_probs
    from megappo.models.hf_config import load_hf_config_dict
    from megappo.parallel import destroy_parallel, init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout
    from megappo.rollout import HFEngine, SamplingParams

    plat = detect_platform()
    ps = init_parallel(ParallelLayout(tp=2, pp=2), plat, seed=0)
    actor = build_model(actor_dir, "actor", ps, plat)
    load_hf_weights(actor, actor_dir, ps)
    engine = HFEngine(stale_dir) if rank == 0 else None  # the rollout engine lives on one rank here
    buckets = iter_hf_weights(actor, ps, load_hf_config_dict(actor_dir), bucket_bytes=64 << 10)
    if engine is not None:
        version = engine.update_weights(buckets, version=3)
    else:
        for _ in buckets:  # collective: every rank takes part in every gather
            pass
    params = SamplingParams(max_new_tokens=6, temperature=TEMPERATURE, n=2, seed=1)
    completions = [c for group in engine.generate(PROMPTS, params) for c in group] if engine else None
    shared = [completions]
    torch.distributed.broadcast_object_list(shared, src=0)
    completions = shared[0]
    batch = ModelBatch.from_token_lists([PROMPTS[c.prompt_index] for c in completions],
                                        [c.output_ids for c in completions], pad_token_id=0)
    logp, _ = compute_log_probs(actor, batch, parallel_state=ps, micro=MicroBatching(micro_batch_size=3),
                                temperature=TEMPERATURE)
    destroy_parallel()
    if rank != 0:
        return None
    return version, completions, logp


def test_synced_engine_samples_what_the_actor_scores(hf_model_dir, tmp_path):
    from megappo.testing.hf_models import make_hf_model

    actor_dir = hf_model_dir("qwen2")
    stale = str(tmp_path / "stale")
    make_hf_model("qwen2", stale, seed=5)  # same architecture, other weights: only the sync can make them agree
    version, completions, logp = run_distributed(_job, 4, actor_dir, stale, timeout=400)[0]
    assert version == 3 and all(c.weight_version == 3 for c in completions)
    assert len(completions) == 2 * len(PROMPTS)
    for i, c in enumerate(completions):
        got = logp[i, : len(c.output_ids)]
        torch.testing.assert_close(got, torch.tensor(c.log_probs), rtol=1e-4, atol=1e-4)
