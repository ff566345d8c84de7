"""Vision-language compute checks shared by tests/unit/test_vlm_compute.py (TP1) and
tests/multirank/test_vlm_compute_layouts.py (TP2 x PP2): an image batch as the trainer builds it, transformers'
per-sequence log-probs, and one job that runs megappo's compute on it (padded and packed).
"""
from __future__ import annotations

import io

import torch

from megappo.testing.dist import run_distributed
from megappo.testing.vlm_models import IMAGE_TOKEN


def vlm_batch(hf_dir: str, sizes=((56, 84), (112, 56), (140, 112), (56, 56)), seed: int = 0):
    """(ModelBatch with multi_modal, [(full ids, MultiModalInputs)]): the image batch split into prompt (text, image
    and 1-3 tokens after it) and response (the rest plus some text), and a text-only row."""
    from megappo.data.multimodal import MultiModalInputs
    from megappo.models.batch import ModelBatch, TrainInputs
    from megappo.testing.vlm_models import image_batch

    b = image_batch(hf_dir, sizes, seed)
    g = torch.Generator().manual_seed(seed)
    prompts, responses, mm = [], [], []
    offset = 0
    for i, (t, h, w) in enumerate(b["image_grid_thw"].tolist()):
        ids = b["input_ids"][i][b["attention_mask"][i].bool()].tolist()
        cut = ids.index(503) + 1 + i % 3  # vision_end, then a few text tokens of the prompt
        extra = torch.randint(1, 400, (3 * i + 1,), generator=g).tolist()
        prompts.append(ids[:cut])
        responses.append(ids[cut:] + extra)
        n = t * h * w
        mm.append(MultiModalInputs(pixel_values=b["pixel_values"][offset: offset + n],
                                   image_grid_thw=b["image_grid_thw"][i: i + 1]))
        offset += n
    prompts.append(torch.randint(1, 400, (4,), generator=g).tolist())  # a text-only row among the image rows
    responses.append(torch.randint(1, 400, (6,), generator=g).tolist())
    mm.append(None)
    # a response that samples the image token: the engine decoded it as text (no pixels), so does the trainer
    prompts.append(prompts[0])
    responses.append([10, IMAGE_TOKEN, 11, 12])
    mm.append(mm[0])
    batch = ModelBatch.from_token_lists(prompts, responses, pad_token_id=0)
    batch.multi_modal = mm
    shape = batch.response_mask.shape
    batch.train = TrainInputs(old_log_probs=-6.0 + 0.1 * torch.randn(shape, generator=g),
                              advantages=torch.randn(shape, generator=g), returns=torch.randn(shape, generator=g),
                              values=0.1 * torch.randn(shape, generator=g))
    rows = [(p + r, m, None) for p, r, m in zip(prompts, responses, mm)]
    # transformers would take the response's image token for a placeholder: its log-prob is read from the prefix,
    # and the tokens after it are not compared
    rows[-1] = (prompts[-1] + [10], mm[-1], IMAGE_TOKEN)
    return batch, rows


def hf_log_probs(hf_dir: str, rows) -> list[torch.Tensor]:
    """transformers' log p(token k | tokens < k), k >= 1, of each sequence run alone (then log p(`then` | all))."""
    import transformers

    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        hf_dir, dtype=torch.float32, local_files_only=True).eval()
    out = []
    for ids, m, then in rows:
        x = torch.tensor([ids])
        kw = {}
        if m is not None:  # as megappo.kinds.qwen2_vl.verify.hf_vlm_forward: mm_token_type_ids give the mrope positions
            kw = dict(pixel_values=m.pixel_values, image_grid_thw=m.image_grid_thw,
                      mm_token_type_ids=(x == model.config.image_token_id).int())
        with torch.no_grad():
            logits = model(input_ids=x, attention_mask=torch.ones_like(x), **kw).logits.float()
        logp = torch.log_softmax(logits[0], -1)
        got = logp[:-1].gather(-1, x[0, 1:, None])[:, 0]
        out.append(got if then is None else torch.cat([got, logp[-1, then:then + 1]]))
    return out


def _job(rank, world_size, hf_dir, layout_kw):
    from megappo.kinds.build import build_model
    from megappo.kinds.weights import load_hf_weights
    from megappo.models.compute import MicroBatching, compute_log_probs, compute_values, train_step
    from megappo.models.losses import ActorLossSettings, actor_loss_fn
    from megappo.models.optim import OptimSettings, build_optimizer, wrap_ddp
    from megappo.parallel import destroy_parallel, init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout

    torch.set_num_threads(1)
    plat = detect_platform()
    ps = init_parallel(ParallelLayout(**layout_kw), plat, seed=0)
    batch, _ = vlm_batch(hf_dir)
    res: dict = {}
    settings = OptimSettings(lr=0.0, weight_decay=0.0, clip_grad=0.0, total_steps=4)
    actor = build_model(hf_dir, "actor", ps, plat, seed=3, freeze_vision_tower=False)
    load_hf_weights(actor, hf_dir, ps)
    ddp = wrap_ddp(actor, settings, plat)
    opt = build_optimizer(ddp, settings, plat)
    loss_fn = actor_loss_fn(ActorLossSettings(entropy_coeff=0.01, use_kl_loss=False))
    for packed in (False, True):
        key = "packed" if packed else "padded"
        micro = MicroBatching(micro_batch_size=2, packed=packed)
        res[f"logp_{key}"], _ = compute_log_probs(ddp, batch, parallel_state=ps, micro=micro)
        m = train_step(ddp, opt, None, batch, loss_fn, parallel_state=ps, micro=micro, platform=plat)
        res[f"step_{key}"] = {"loss": m.loss, "grad_norm": m.grad_norm, **m.metrics}
        res[f"grads_{key}"] = [p.main_grad.detach().clone() for c in ddp for p in c.parameters()]
    from megappo.data.multimodal import MultiModalInputs

    blank = batch.select(list(range(batch.batch_size)))
    blank.multi_modal = [None if m is None else MultiModalInputs(torch.zeros_like(m.pixel_values), m.image_grid_thw)
                         for m in batch.multi_modal]
    res["logp_blank_images"], _ = compute_log_probs(ddp, blank, parallel_state=ps, micro=MicroBatching())
    critic = build_model(hf_dir, "critic", ps, plat, seed=3)
    load_hf_weights(critic, hf_dir, ps)
    for packed in (False, True):
        res[f"values_{'packed' if packed else 'padded'}"] = compute_values(
            critic, batch, parallel_state=ps, micro=MicroBatching(micro_batch_size=3, packed=packed))
    destroy_parallel()
    buf = io.BytesIO()
    torch.save(res, buf)
    return buf.getvalue()


def run_vlm_compute(hf_dir: str, world: int, layout_kw: dict, timeout: int = 300) -> list[dict]:
    raw = run_distributed(_job, world, hf_dir, layout_kw, timeout=timeout)
    return [torch.load(io.BytesIO(r), weights_only=False) for r in raw]


def check_vlm_compute(hf_dir: str, res: dict) -> None:
    batch, rows = vlm_batch(hf_dir)
    ref = hf_log_probs(hf_dir, rows)
    p = batch.prompt_len
    for i, want in enumerate(ref):
        plen = len(batch.input_ids[i][: p].nonzero())
        n = min(int(batch.response_mask[i].sum()), len(want) - (plen - 1))
        for key in ("logp_padded", "logp_packed"):
            got = res[key][i, :n]
            torch.testing.assert_close(got, want[plen - 1: plen - 1 + n], rtol=0, atol=1e-4, msg=f"{key} row {i}")
    image_rows = [i for i, m in enumerate(batch.multi_modal) if m is not None]
    assert (res["logp_blank_images"][image_rows] - res["logp_padded"][image_rows]).abs().max() > 1e-2
    torch.testing.assert_close(res["values_packed"], res["values_padded"], rtol=0, atol=1e-5)
    assert res["values_padded"].abs().sum() > 0
    for k, v in res["step_padded"].items():
        assert abs(res["step_packed"][k] - v) <= 1e-5 * max(abs(v), 1e-6), (k, res["step_packed"][k], v)
    assert res["step_padded"]["grad_norm"] > 0
    for a, b in zip(res["grads_packed"], res["grads_padded"], strict=True):
        assert (a - b).abs().max() <= 1e-5 * max(b.abs().max().item(), 1e-12)
    assert sum(int(g.abs().sum() > 0) for g in res["grads_padded"]) > 0
