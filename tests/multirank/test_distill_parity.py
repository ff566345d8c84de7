"""On-policy distillation's numbers against `transformers` on the same tokens: the built-in task's student (Qwen2)
and its teacher (a larger Llama with the same tokenizer) through megatron, on one rank and over two tensor-parallel
ranks (a vocabulary split in two): the per-token reverse KL log pi_s - log pi_t, the teacher's top-k tokens and
log-probs, and the student's log-probs of those tokens (with their gradient) within 1e-5 of a direct computation."""
from __future__ import annotations

import pytest
import torch

from megappo.testing.dist import run_distributed

pytestmark = pytest.mark.multirank
K = 8


def _tokens(student_dir):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(student_dir)
    g = torch.Generator().manual_seed(3)
    prompts = [tok(f"max {a} {b} {c} {d} =")["input_ids"] for a, b, c, d in torch.randint(0, 10, (5, 4), generator=g)
               .tolist()]
    digits = tok.convert_tokens_to_ids([str(d) for d in range(10)])
    responses = [[digits[int(d)] for d in torch.randint(0, 10, (n,), generator=g)] + [tok.eos_token_id]
                 for n in (1, 2, 1, 3, 1)]
    return prompts, responses


def _job(rank, world_size, student_dir, teacher_dir):
    from megappo.kinds.build import build_model
    from megappo.kinds.weights import load_hf_weights
    from megappo.models.batch import ModelBatch, TrainInputs
    from megappo.models.builder import unwrap
    from megappo.models.compute import MicroBatching, compute_log_probs, compute_topk_log_probs
    from megappo.models.topk import vocab_parallel_log_probs_at
    from megappo.parallel import destroy_parallel, init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout

    plat = detect_platform()
    ps = init_parallel(ParallelLayout(tp=world_size), plat, seed=0)
    prompts, responses = _tokens(student_dir)
    batch = ModelBatch.from_token_lists(prompts, responses, pad_token_id=0)
    micro = MicroBatching(micro_batch_size=2)
    out = {}
    for name, path, role in (("student", student_dir, "actor"), ("teacher", teacher_dir, "teacher")):
        chunks = build_model(path, role, ps, plat, seed=0)
        load_hf_weights(chunks, path, ps)
        out[name] = compute_log_probs(chunks, batch, parallel_state=ps, micro=micro)[0]
        if name == "teacher":
            _, out["topk_lp"], out["topk_ids"] = compute_topk_log_probs(chunks, batch, K, parallel_state=ps,
                                                                        micro=micro)
        else:
            student = chunks
    # the student's log-probs of the teacher's tokens, through the model and back: value and gradient
    inner = unwrap(student[0])
    ids = batch.input_ids
    logits = inner(input_ids=ids, position_ids=batch.position_ids, attention_mask=None)  # [B, T, V/tp]
    window = logits[:, batch.prompt_len - 1:-1]
    at = vocab_parallel_log_probs_at(window, out["topk_ids"], ps.tp_group,
                                     vocab_size=inner.megappo_spec.vocab_size)
    (at.exp() * batch.response_mask.unsqueeze(-1)).sum().backward()
    grad = inner.output_layer.weight.grad.clone()  # this rank's vocabulary rows
    out.update(at=at.detach(), grad=grad, mask=batch.response_mask, batch=batch)
    destroy_parallel()
    return out


@pytest.fixture(scope="module")
def task_models(tmp_path_factory):
    from megappo.tasks import prepare_task
    from megappo.tasks.teacher import prepare_teacher

    root = tmp_path_factory.mktemp("distill")
    student = prepare_task("digit_max", str(root / "task"), warm_start_steps=20, num_train_prompts=64).model_dir
    teacher = prepare_teacher("digit_max", str(root / "teacher"), smoothing=0.05, warm_start_steps=20,
                              num_val_prompts=64)
    return student, teacher


@pytest.mark.parametrize("tp", [1, 2])
def test_reverse_kl_and_topk_match_transformers(task_models, tp):
    import transformers

    student_dir, teacher_dir = task_models
    ranks = run_distributed(_job, tp, student_dir, teacher_dir, timeout=300)
    out = ranks[0]
    prompts, responses = _tokens(student_dir)
    hf_s = transformers.AutoModelForCausalLM.from_pretrained(student_dir, torch_dtype=torch.float32).eval()
    hf_t = transformers.AutoModelForCausalLM.from_pretrained(teacher_dir, torch_dtype=torch.float32).eval()
    assert type(hf_t).__name__ == "LlamaForCausalLM" and type(hf_s).__name__ == "Qwen2ForCausalLM"
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids = torch.tensor([p + r])
        with torch.no_grad():
            ls = torch.log_softmax(hf_s(input_ids=ids).logits[0, len(p) - 1:-1].float(), -1)
            lt = torch.log_softmax(hf_t(input_ids=ids).logits[0, len(p) - 1:-1].float(), -1)
        target = torch.tensor(r).unsqueeze(-1)
        direct_k1 = ls.gather(-1, target).squeeze(-1) - lt.gather(-1, target).squeeze(-1)
        k1 = out["student"][i, :len(r)] - out["teacher"][i, :len(r)]
        assert (k1 - direct_k1).abs().max() <= 1e-5, (k1, direct_k1)
        top_lp, top_ids = lt.topk(K, -1)
        assert torch.equal(out["topk_ids"][i, :len(r)], top_ids)
        assert (out["topk_lp"][i, :len(r)] - top_lp).abs().max() <= 1e-5
        assert (out["at"][i, :len(r)] - ls.gather(-1, top_ids)).abs().max() <= 1e-5
        assert not out["topk_lp"][i, len(r):].any() and not out["topk_ids"][i, len(r):].any()
    if tp == 2:  # each rank's gradient is its own vocabulary rows' share of the one-rank gradient
        (one,) = run_distributed(_job, 1, student_dir, teacher_dir, timeout=300)
        rows = ranks[0]["grad"].shape[0]
        whole = torch.cat([ranks[0]["grad"], ranks[1]["grad"]])[:one["grad"].shape[0]]
        torch.testing.assert_close(whole, one["grad"][:2 * rows], rtol=1e-4, atol=1e-6)
