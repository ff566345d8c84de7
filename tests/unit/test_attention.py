"""`megappo.models.attention.SDPAttention` reproduces megatron's local `DotProductAttention`.

Each job runs in its own spawned process (megatron's parallel state is process-global): one compares the two
modules on the same q/k/v (outputs and gradients, fp32), one a whole tiny megappo-built GPTModel against the same
weights with megatron's attention put back, and against `transformers` on padded rows.
"""
from __future__ import annotations

import pytest
import torch

from megappo.testing.dist import run_distributed

SEQ, BATCH, HEAD_DIM = 12, 3, 16


def _config(heads: int, groups: int, **kw):
    from megatron.core.transformer import TransformerConfig

    kw = {"attention_dropout": 0.0, **kw}
    return TransformerConfig(num_layers=1, hidden_size=heads * HEAD_DIM, num_attention_heads=heads,
                             num_query_groups=groups, kv_channels=HEAD_DIM, use_cpu_initialization=True, **kw)


def _padding_mask() -> torch.Tensor:
    """[b, 1, s, s] True = blocked: causal plus per-row key padding (left and right), with fully blocked rows."""
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
    keys_ok = torch.ones(BATCH, SEQ, dtype=torch.bool)
    keys_ok[0, :3] = False  # left padding: queries 0..2 of row 0 see nothing
    keys_ok[1, 9:] = False  # right padding
    keys_ok[2, ::4] = False  # arbitrary holes
    return causal.view(1, 1, SEQ, SEQ) | ~keys_ok.view(BATCH, 1, 1, SEQ)


def _module_job(rank, world_size):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megappo.models.attention import SDPAttention
    from megappo.parallel import destroy_parallel, init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout

    ps = init_parallel(ParallelLayout(), detect_platform(), seed=0)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).view(1, 1, SEQ, SEQ)
    cases = {
        "mha_causal_none": (4, 4, None, {}),
        "gqa_causal_none": (4, 2, None, {}),
        "gqa_causal_given": (4, 2, causal, {}),
        "gqa_causal_given_batch": (4, 2, causal.expand(BATCH, 1, SEQ, SEQ).contiguous(), {}),
        "gqa_padding": (4, 2, _padding_mask(), {}),
        "mha_padding_2d": (4, 4, _padding_mask()[2, 0], {}),
        "gqa_layer_scaling": (4, 2, None, dict(apply_query_key_layer_scaling=True, attention_softmax_in_fp32=True)),
        "gqa_softmax_scale": (4, 2, _padding_mask(), dict(softmax_scale=0.3)),
    }
    out = {}
    for name, (heads, groups, mask, kw) in cases.items():
        cfg = _config(heads, groups, **kw)
        g = torch.Generator().manual_seed(len(name))
        q = torch.randn(SEQ, BATCH, heads, HEAD_DIM, generator=g)
        k = torch.randn(SEQ, BATCH, groups, HEAD_DIM, generator=g)
        v = torch.randn(SEQ, BATCH, groups, HEAD_DIM, generator=g)
        grad = torch.randn(SEQ, BATCH, heads * HEAD_DIM, generator=g)
        results = []
        for cls in (DotProductAttention, SDPAttention):
            m = cls(config=cfg, layer_number=3, attn_mask_type=AttnMaskType.causal, attention_type="self",
                    softmax_scale=cfg.softmax_scale, pg_collection=ps.pg_collection)
            qi, ki, vi = (t.clone().requires_grad_(True) for t in (q, k, v))
            o = m(qi, ki, vi, mask, attn_mask_type=AttnMaskType.causal, attention_bias=None, packed_seq_params=None)
            o.backward(grad)
            results.append((o.detach(), qi.grad, ki.grad, vi.grad))
        out[name] = [(a - b).abs().max().item() for a, b in zip(*results)]
        out[name + ":shape"] = (tuple(results[0][0].shape), tuple(results[1][0].shape))

    # bf16 with the softmax asked in fp32: no less precise than megatron's (both against a float64 reference)
    cfg = _config(4, 2, bf16=True, params_dtype=torch.bfloat16, attention_softmax_in_fp32=True)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(SEQ, BATCH, n, HEAD_DIM, generator=g) * 2 for n in (4, 2, 2))
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.double().permute(1, 2, 0, 3).repeat_interleave(4 // t.size(2), 1) for t in (q, k, v)), is_causal=True
    ).permute(2, 0, 1, 3).reshape(SEQ, BATCH, -1)
    errs = []
    for cls in (DotProductAttention, SDPAttention):
        m = cls(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                pg_collection=ps.pg_collection)
        o = m(q.bfloat16(), k.bfloat16(), v.bfloat16(), None)
        errs.append(((o.double() - ref).abs().max().item(), o.dtype))
    out["bf16"] = errs

    # dropout: SDPA's dropout_p in training mode only, drawn from megatron's tracked RNG state
    cfg = _config(4, 2, attention_dropout=0.5)
    m = SDPAttention(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                     pg_collection=ps.pg_collection)
    q = torch.randn(SEQ, BATCH, 4, HEAD_DIM)
    k = v = torch.randn(SEQ, BATCH, 2, HEAD_DIM)
    m.eval()
    ev = m(q, k, v, None)
    m.train()
    tr1, tr2 = m(q, k, v, None), m(q, k, v, None)
    out["dropout"] = dict(eval_p=m.dropout_p, train_differs_from_eval=not torch.allclose(tr1, ev),
                          draws_differ=not torch.allclose(tr1, tr2), finite=bool(tr1.isfinite().all()))
    destroy_parallel()
    return out


@pytest.fixture(scope="module")
def module_results():
    (out,) = run_distributed(_module_job, 1, timeout=120)
    return out


@pytest.mark.parametrize("case", ["mha_causal_none", "gqa_causal_none", "gqa_causal_given", "gqa_causal_given_batch",
                                  "gqa_padding", "mha_padding_2d", "gqa_layer_scaling", "gqa_softmax_scale"])
def test_matches_megatron_dot_product_attention(module_results, case):
    (mshape, sshape) = module_results[case + ":shape"]
    assert mshape == sshape == (SEQ, BATCH, 4 * HEAD_DIM)
    out_diff, dq, dk, dv = module_results[case]
    assert out_diff <= 1e-5 and dq <= 1e-5 and dk <= 1e-5 and dv <= 1e-5, module_results[case]


def test_dropout_only_in_training(module_results):
    d = module_results["dropout"]
    assert d == dict(eval_p=0.5, train_differs_from_eval=True, draws_differ=True, finite=True)


def test_bf16_is_no_less_precise_than_megatron(module_results):
    (megatron_err, megatron_dtype), (sdpa_err, sdpa_dtype) = module_results["bf16"]
    assert megatron_dtype == sdpa_dtype == torch.bfloat16
    assert sdpa_err <= max(megatron_err, 1e-2) * 1.25, module_results["bf16"]


PLENS, RLENS = [3, 9, 1, 5], [6, 2, 7, 1]


def _model_job(rank, world_size, hf_dir):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megappo.kinds.build import build_model
    from megappo.kinds.weights import load_hf_weights
    from megappo.models.attention import SDPAttention
    from megappo.models.batch import ModelBatch
    from megappo.models.compute import MicroBatching, compute_log_probs
    from megappo.parallel import destroy_parallel, init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout

    plat = detect_platform()
    ps = init_parallel(ParallelLayout(), plat, seed=0)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, 400, (n,), generator=g).tolist() for n in PLENS]
    responses = [torch.randint(1, 400, (n,), generator=g).tolist() for n in RLENS]
    batch = ModelBatch.from_token_lists(prompts, responses, pad_token_id=0)
    batch = batch.pad_to(batch.batch_size, batch.prompt_len + 1, batch.response_len + 2)
    (model,) = build_model(hf_dir, "actor", ps, plat, seed=0)
    load_hf_weights([model], hf_dir, ps)
    layers = model.decoder.layers
    kinds = [type(layer.self_attention.core_attention).__name__ for layer in layers]
    swapped = bool(model.megappo_sdpa_attention)
    logp, _ = compute_log_probs([model], batch, parallel_state=ps, micro=MicroBatching(micro_batch_size=3))

    # the same weights through the whole model with either attention, under the causal mask and a padding mask
    model.eval()
    ids, pos = batch.input_ids, batch.position_ids
    s = ids.shape[1]
    pad_mask = ~batch.attention_mask.bool()
    padding = torch.ones(s, s, dtype=torch.bool).triu(1).view(1, 1, s, s) | pad_mask.view(-1, 1, 1, s)
    masks = {"none": None, "causal": torch.ones(s, s, dtype=torch.bool).triu(1).view(1, 1, s, s), "padding": padding}
    with torch.no_grad():
        new = {k: model(input_ids=ids, position_ids=pos, attention_mask=m) for k, m in masks.items()}
        for layer in layers:
            sa = layer.self_attention
            sa.core_attention = DotProductAttention(config=sa.config, layer_number=sa.layer_number,
                                                    attn_mask_type=sa.attn_mask_type, attention_type="self",
                                                    softmax_scale=sa.config.softmax_scale,
                                                    pg_collection=sa.pg_collection)
        old = {k: model(input_ids=ids, position_ids=pos, attention_mask=m) for k, m in masks.items()}
    diffs = {k: (new[k] - old[k]).abs().max().item() for k in masks}
    destroy_parallel()
    return {"kinds": kinds, "swapped": swapped, "log_probs": logp, "mask": batch.response_mask, "diffs": diffs,
            "sdpa_name": SDPAttention.__name__}


def test_megappo_model_uses_sdpa_and_matches_megatron_and_transformers(hf_model_dir):
    import transformers

    hf_dir = hf_model_dir("qwen2")
    (out,) = run_distributed(_model_job, 1, hf_dir, timeout=300)
    assert out["swapped"] and out["kinds"] == [out["sdpa_name"]] * len(out["kinds"])
    # whole model, same weights: megatron's DotProductAttention vs SDPAttention under each kind of mask
    for kind, diff in out["diffs"].items():
        assert diff <= 1e-4, (kind, out["diffs"])
    # log-probs on padded rows (no mask passed: the model applies the causal mask) vs transformers on each row
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, 400, (n,), generator=g).tolist() for n in PLENS]
    responses = [torch.randint(1, 400, (n,), generator=g).tolist() for n in RLENS]
    for i, (p, r) in enumerate(zip(prompts, responses)):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1: len(p) + len(r) - 1].float()
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r).unsqueeze(-1)).squeeze(-1)
        assert out["mask"][i, : len(r)].all()
        torch.testing.assert_close(out["log_probs"][i, : len(r)], ref, rtol=1e-4, atol=1e-4)
