"""The megatron actor's log-probs, entropy, sum p^2 on a padded batch equal `transformers` on each row without padding.

Rows have different prompt (left-padded) and response (right-padded) lengths, so this pins the left-alignment in
`megappo.models.compute` (the model sees every row rolled to column 0 under the plain causal mask) and the read-back
of the response window, against an independent implementation that never sees padding.
"""
from __future__ import annotations

import pytest
import torch

from megappo.testing.dist import run_distributed

pytestmark = pytest.mark.multirank

PLENS, RLENS = [3, 9, 1, 5], [6, 2, 7, 1]


def _token_lists():
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, 400, (n,), generator=g).tolist() for n in PLENS]
    responses = [torch.randint(1, 400, (n,), generator=g).tolist() for n in RLENS]
    return prompts, responses


def _job(rank, world_size, hf_dir):
    from megappo.kinds.build import build_model
    from megappo.kinds.weights import load_hf_weights
    from megappo.models.batch import ModelBatch
    from megappo.models.compute import MicroBatching, compute_log_probs, compute_values
    from megappo.parallel import destroy_parallel, init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout

    plat = detect_platform()
    ps = init_parallel(ParallelLayout(), plat, seed=0)
    prompts, responses = _token_lists()
    # one extra all-padding prompt column, so no row starts at column 0
    batch = ModelBatch.from_token_lists(prompts, responses, pad_token_id=0)
    batch = batch.pad_to(batch.batch_size, batch.prompt_len + 1, batch.response_len + 2)
    chunks = build_model(hf_dir, "actor", ps, plat, seed=0)
    load_hf_weights(chunks, hf_dir, ps)
    logp, ent, sq = compute_log_probs(chunks, batch, parallel_state=ps, micro=MicroBatching(micro_batch_size=3),
                                      calculate_entropy=True, calculate_sum_pi_squared=True)
    critic = build_model(hf_dir, "critic", ps, plat, seed=0)
    load_hf_weights(critic, hf_dir, ps)
    values = compute_values(critic, batch, parallel_state=ps, micro=MicroBatching(micro_batch_size=2))
    # the critic's head is freshly initialised, so its reference is the same model on each row alone, unpadded
    alone = [compute_values(critic, ModelBatch.from_token_lists([p], [r], pad_token_id=0), parallel_state=ps,
                            micro=MicroBatching(micro_batch_size=1))[0] for p, r in zip(prompts, responses)]
    destroy_parallel()
    return {"log_probs": logp, "entropy": ent, "sum_pi_squared": sq, "mask": batch.response_mask, "values": values,
            "alone": alone}


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_padded_batch_matches_transformers_per_row(hf_model_dir, family):
    import transformers

    hf_dir = hf_model_dir(family)
    (out,) = run_distributed(_job, 1, hf_dir, timeout=300)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    prompts, responses = _token_lists()
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids = torch.tensor([p + r])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(p) - 1: len(p) + len(r) - 1].float()
        ref_logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r).unsqueeze(-1)).squeeze(-1)
        ref_ent = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
        assert out["mask"][i, : len(r)].all() and not out["mask"][i, len(r):].any()
        torch.testing.assert_close(out["log_probs"][i, : len(r)], ref_logp, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out["entropy"][i, : len(r)], ref_ent, rtol=1e-4, atol=1e-4)
        ref_sq = torch.softmax(logits, -1).pow(2).sum(-1)  # the optimal token baselines' input
        torch.testing.assert_close(out["sum_pi_squared"][i, : len(r)], ref_sq, rtol=1e-4, atol=1e-6)
        assert not out["sum_pi_squared"][i, len(r):].any()
        torch.testing.assert_close(out["values"][i, : len(r)], out["alone"][i], rtol=1e-5, atol=1e-5)
