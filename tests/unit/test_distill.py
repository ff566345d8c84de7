"""On-policy distillation's pure parts: the divergences and the advantage (megappo/algos/distillation.py), top-k over
a vocabulary on one rank (megappo/models/topk.py; two ranks: tests/multirank/test_distill_parity.py), the config's
rules (megappo/distill/checks.py) and the teachers' routing by data source."""
from __future__ import annotations

import math

import pytest
import torch

from megappo.algos import distillation as d
from megappo.config import load_config
from megappo.config.fields import ConfigError
from megappo.checks import validate
from megappo.models.topk import vocab_parallel_log_probs_at, vocab_parallel_topk

RECIPE = "recipes/cpu/tiny_distill.yaml"


def test_divergences_on_sampled_tokens():
    s = torch.tensor([[-0.1, -2.0, -30.0]])
    t = torch.tensor([[-0.5, -0.2, -1.0]])
    torch.testing.assert_close(d.token_divergence(s, t, "k1"), s - t)
    x = t - s
    torch.testing.assert_close(d.token_divergence(s, t, "k3"), (x.exp() - x - 1).clamp(-10, 10))
    # log-probs clamped below first: the student's -30 counts as -10; then the result clamped to +-5
    clamped = d.token_divergence(s, t, "k1", log_prob_min_clamp=-10.0, loss_max_clamp=5.0)
    torch.testing.assert_close(clamped, torch.tensor([[0.4, -1.8, -5.0]]))
    assert (d.token_divergence(s, t, "k3") >= 0).all()


def test_forward_kl_topk_is_the_full_kl_when_k_is_the_vocabulary():
    g = torch.Generator().manual_seed(0)
    ls, lt = torch.log_softmax(torch.randn(2, 3, 7, generator=g), -1), torch.log_softmax(torch.randn(2, 3, 7,
                                                                                                  generator=g), -1)
    full = (lt.exp() * (lt - ls)).sum(-1)
    torch.testing.assert_close(d.forward_kl_topk(ls, lt), full)
    top_t, ids = lt.topk(3, -1)
    part = d.forward_kl_topk(ls.gather(-1, ids), top_t)
    assert (part <= full + 1e-6).all() is not None  # the left-out mass makes it a partial sum
    # a -inf teacher row (no teacher for it) adds nothing, and no NaN
    none = d.forward_kl_topk(ls.gather(-1, ids), torch.full_like(top_t, float("-inf")))
    assert torch.equal(none, torch.zeros_like(none))


def test_advantage_is_minus_the_divergence_plus_the_task_advantage():
    div, mask = torch.tensor([[0.5, -0.25, 3.0]]), torch.tensor([[1.0, 1.0, 0.0]])
    torch.testing.assert_close(d.distill_advantages(None, div, mask, coef=7.0), torch.tensor([[-0.5, 0.25, 0.0]]))
    task = torch.tensor([[1.0, 1.0, 1.0]])
    torch.testing.assert_close(d.distill_advantages(task, div, mask, coef=2.0), torch.tensor([[0.0, 1.5, 0.0]]))


def test_topk_and_log_probs_at_on_one_rank_match_log_softmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 4, 11, generator=g, requires_grad=True)
    lp, ids = vocab_parallel_topk(logits, 3, None, vocab_size=9)  # the last two columns are TP padding
    ref = torch.log_softmax(logits[..., :9].detach(), -1)
    want_lp, want_ids = ref.topk(3, -1)
    assert torch.equal(ids, want_ids) and (ids < 9).all()
    torch.testing.assert_close(lp, want_lp)
    at = vocab_parallel_log_probs_at(logits, ids, None, vocab_size=9, temperature=2.0)
    direct = torch.log_softmax(logits[..., :9] / 2.0, -1).gather(-1, ids)
    torch.testing.assert_close(at, direct)
    (g1,) = torch.autograd.grad(at.sum(), logits)
    (g2,) = torch.autograd.grad(direct.sum(), logits)
    torch.testing.assert_close(g1, g2)
    with pytest.raises(ValueError, match="at most the vocabulary size"):
        vocab_parallel_topk(logits, 12, None)


def _errors(*overrides: str) -> str:
    cfg = load_config(RECIPE, list(overrides))
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=1, check_files=False)
    return str(e.value)


def test_recipe_is_valid_and_bad_settings_name_the_fix():
    validate(load_config(RECIPE), world_size=1, check_files=False)
    assert "use loss_mode=k3" in _errors("distillation.distillation_loss.use_policy_gradient=false")
    assert "set use_policy_gradient=false" in _errors("distillation.distillation_loss.loss_mode=forward_kl_topk")
    assert "set their backend=megatron" in _errors(
        "distillation.distillation_loss.loss_mode=forward_kl_topk",
        "distillation.distillation_loss.use_policy_gradient=false", "distillation.teacher_model.model_path=/x",
        "distillation.teacher_model.backend=engine")
    assert "no teacher is named" in _errors("data.synthetic.teacher_smoothing=null")
    assert "did you mean distillation.teacher_models.b.model_path?" in _errors(
        "distillation.teacher_models={b: {model_pth: /x}}")
    assert "at most one teacher" in _errors("distillation.teacher_model.model_path=/x",
                                            "distillation.teacher_models={b: {model_path: /y}}")
    assert "one teacher scores each data source" in _errors(
        "distillation.teacher_models={a: {model_path: /x, data_sources: [s]}, b: {model_path: /y, data_sources: [s]}}")
    assert "temperature 1" in _errors("distillation.teacher_model.backend=engine",
                                      "actor_rollout_ref.rollout.temperature=0.7")
    with pytest.raises(ConfigError, match="did you mean"):
        load_config(RECIPE, ["distillation.distilation_loss.topk=4"])


def test_teachers_route_by_data_source():
    from megappo.distill.checks import TeacherSpec
    from megappo.trainer.teachers import Teachers

    class Stub:  # routing reads only the specs
        def __init__(self, name, sources):
            self.spec = TeacherSpec(name, "/m", "megatron", tuple(sources))

    both = Teachers([Stub("math", ["gsm8k"]), Stub("rest", [])], topk=0)
    assert both.route(["gsm8k", "other", "gsm8k"]) == [0, 1, 0]
    only = Teachers([Stub("math", ["gsm8k"])], topk=0)
    assert only.route(["gsm8k", "other"]) == [0, None]
    assert math.isfinite(len(both.names)) and both.names == ["math", "rest"]


def test_preflight_names_a_teacher_that_cannot_serve_the_student(tmp_path):
    import json

    from megappo.distill.checks import teacher_model_problems

    def model(name, **hf):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(hf))
        return str(tmp_path / name)

    student = model("student", vocab_size=20, num_attention_heads=4, num_hidden_layers=2)
    good = model("good", vocab_size=20, num_attention_heads=4, num_hidden_layers=4)
    other = model("other", vocab_size=32, num_attention_heads=6, num_hidden_layers=3)
    cfg = load_config(RECIPE, [f"actor_rollout_ref.model.path={student}", f"distillation.teacher_model.model_path={good}"])
    assert teacher_model_problems(cfg, 2, 2) == []
    cfg = load_config(RECIPE, [f"actor_rollout_ref.model.path={student}", f"distillation.teacher_model.model_path={other}"])
    problems = " ".join(teacher_model_problems(cfg, 4, 2))
    assert "vocabulary (32 tokens) is not the student's (20)" in problems
    assert "6 attention heads do not divide over tensor_model_parallel_size=4" in problems
    assert "3 layers do not split into pipeline_model_parallel_size=2" in problems


def test_the_gpu_distillation_recipe_fits_its_models(tmp_path):
    """gsm8k/qwen3-1.7b_opd_from_qwen3-8b against the real models' shapes: the teacher's heads and layers in the
    student's layout, one vocabulary (Qwen3's 151936)."""
    import json

    from megappo.distill.checks import teacher_model_problems
    from megappo.trainer.preflight import preflight

    def model(name, **hf):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 151936, **hf}))
        return str(tmp_path / name)

    student = model("Qwen3-1.7B", num_attention_heads=16, num_key_value_heads=8, num_hidden_layers=28)
    teacher = model("Qwen3-8B", num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=36)
    cfg = load_config("gsm8k/qwen3-1.7b_opd_from_qwen3-8b", [f"actor_rollout_ref.model.path={student}",
                                                              f"distillation.teacher_model.model_path={teacher}"])
    preflight(cfg, 8, check_files=False)
    assert teacher_model_problems(cfg, 2, 1) == []
    d = cfg.distillation
    assert d.enabled and d.teacher_model.backend == "megatron" and d.distillation_loss.loss_mode == "k1"
    assert (cfg.actor_rollout_ref.actor.optim.lr, cfg.data.train_batch_size) == (1e-6, 512)  # verl's OPD example


def test_a_fixed_model_engine_takes_the_policy_rollout_under_its_own_keys():
    from megappo.config.schema.rollout import InferenceConfig
    from megappo.rollout.fixed import fixed_settings
    from megappo.trainer.settings import rollout_settings

    cfg = load_config(RECIPE, ["actor_rollout_ref.rollout.engine_kwargs={threads: 2}",
                               "actor_rollout_ref.rollout.max_num_seqs=64"])
    policy = rollout_settings(cfg)
    same = fixed_settings(policy, "/teacher", InferenceConfig())
    assert (same.name, same.model_path, same.engine_kwargs, same.max_num_seqs) == ("hf", "/teacher", {"threads": 2}, 64)
    assert same.lora_adapter is None and same.hybrid_engine == policy.hybrid_engine
    own = fixed_settings(policy, "/t", InferenceConfig(name="sglang", server_urls=["http://h:1"], max_num_seqs=8,
                                                       tensor_model_parallel_size=4, hybrid_engine=False))
    assert (own.name, own.server_urls, own.max_num_seqs, own.tensor_model_parallel_size) == (
        "sglang", ("http://h:1",), 8, 4)
    assert own.engine_kwargs == {} and own.hybrid_engine is False  # another engine: not the policy's arguments
