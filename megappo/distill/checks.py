"""The config's distillation rules and its teachers as specs (`teacher_specs`), collected into the messages
`megappo.checks` reports; reads the tree alone (no torch)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import difflib
import json
import os
from typing import Any

from megappo.config.schema.distill import TeacherModelConfig
from megappo.config.schema.rollout import InferenceConfig
from megappo.models.layout import per_position_topk_refusal

KEY = "distillation"


def _build(cls: type, entry: Any, key: str) -> Any:
    """`cls(**entry)` for a mapping from a recipe, an unknown key named with the nearest one."""
    if isinstance(entry, cls):
        return entry
    if not isinstance(entry, dict):
        raise ValueError(f"{key}: expected a mapping of {', '.join(f.name for f in dataclasses.fields(cls))}, "
                         f"got {entry!r}")
    names = [f.name for f in dataclasses.fields(cls)]
    for k in entry:
        if k not in names:
            near = difflib.get_close_matches(k, names, n=1)
            raise ValueError(f"{key}.{k} is not a key" + (f"; did you mean {key}.{near[0]}?" if near else
                                                         f" (keys: {', '.join(names)})"))
    values = dict(entry)
    if cls is TeacherModelConfig and "inference" in values:
        values["inference"] = _build(InferenceConfig, values["inference"], f"{key}.inference")
    return cls(**values)


def teacher_configs(cfg) -> dict[str, TeacherModelConfig]:
    """Every teacher's config by name: "teacher" (distillation.teacher_model, when it has a model_path) and
    distillation.teacher_models' entries. Raises ValueError on a malformed entry."""
    d = cfg.distillation
    synthetic = cfg.data.synthetic.teacher_smoothing is not None  # the trainer fills in its path at setup
    out = {"teacher": d.teacher_model} if d.teacher_model.model_path or synthetic else {}
    for name, entry in d.teacher_models.items():
        if name == "teacher":
            raise ValueError(f"{KEY}.teacher_models.teacher: the name 'teacher' is distillation.teacher_model's; "
                             "give this teacher another name")
        out[str(name)] = _build(TeacherModelConfig, entry, f"{KEY}.teacher_models.{name}")
    return out


@dataclass(frozen=True)
class TeacherSpec:
    name: str  # "teacher" for distillation.teacher_model; the key of distillation.teacher_models otherwise
    model_path: str
    backend: str  # megatron | engine
    data_sources: tuple[str, ...]  # empty: every data source no other teacher names
    inference: Any = None  # InferenceConfig (engine)


def teacher_specs(cfg) -> list[TeacherSpec]:
    return [TeacherSpec(name, t.model_path, t.backend, tuple(t.data_sources), t.inference)
            for name, t in teacher_configs(cfg).items()]


def distillation_errors(cfg, check_files: bool = False) -> list[str]:
    """Every distillation rule of `cfg`."""
    errors: list[str] = []
    if cfg.distillation.enabled:
        _check_distillation(cfg, errors, check_files)
    return errors


def _check_distillation(cfg, errors: list[str], check_files: bool) -> None:
    try:
        teachers = teacher_configs(cfg)
    except ValueError as e:
        errors.append(str(e))
        return
    if not teachers:
        errors.append(f"{KEY}.teacher_model.model_path: distillation is enabled but no teacher is named; set it to "
                      f"the teacher's Hugging Face directory (or add {KEY}.teacher_models)")
    syn = cfg.data.synthetic
    if "teacher" in teachers and not teachers["teacher"].model_path and not syn.name:
        errors.append(f"{KEY}.teacher_model.model_path: is not set, and data.synthetic.teacher_smoothing="
                      f"{syn.teacher_smoothing} makes a teacher only for a built-in task (data.synthetic.name is null: "
                      f"this run reads data.train_files); set {KEY}.teacher_model.model_path=DIR to the teacher's "
                      "Hugging Face directory (the student's tokenizer), or drop data.synthetic.teacher_smoothing")
    _check_routes(teachers, errors)
    _check_loss(cfg, teachers, errors)
    for name, t in teachers.items():
        key = f"{KEY}.teacher_model" if name == "teacher" else f"{KEY}.teacher_models.{name}"
        if not t.model_path:
            if name != "teacher":  # "teacher" without a path is the synthetic task's
                errors.append(f"{key}.model_path: a teacher needs its Hugging Face directory")
        elif check_files and not os.path.isfile(os.path.join(os.path.expanduser(t.model_path), "config.json")):
            errors.append(f"{key}.model_path: {t.model_path} has no config.json; point it at a Hugging Face "
                          "directory (megappo convert mcore-to-hf writes one)")
        if t.backend == "engine" and cfg.actor_rollout_ref.rollout.temperature != 1.0:
            errors.append(f"{key}.backend=engine: an engine's log-probs are at temperature 1, the student's at "
                          f"actor_rollout_ref.rollout.temperature={cfg.actor_rollout_ref.rollout.temperature}; use "
                          "backend=megatron (which scores at the student's temperature) or temperature 1")


def _check_routes(teachers: dict, errors: list[str]) -> None:
    defaults = [n for n, t in teachers.items() if not t.data_sources]
    if len(defaults) > 1:
        errors.append(f"{KEY}: teachers {defaults} name no data_sources; at most one teacher takes every data source "
                      "the others do not name: give the others their data_sources")
    owner: dict[str, str] = {}
    for name, t in teachers.items():
        for ds in t.data_sources:
            if ds in owner:
                errors.append(f"{KEY}: data source {ds!r} is named by teachers {owner[ds]!r} and {name!r}; one "
                              "teacher scores each data source")
            owner[ds] = name


def _check_loss(cfg, teachers: dict, errors: list[str]) -> None:
    dl, key = cfg.distillation.distillation_loss, f"{KEY}.distillation_loss"
    if dl.loss_mode in ("k1", "kl") and not dl.use_policy_gradient:
        errors.append(f"{key}.loss_mode={dl.loss_mode} with use_policy_gradient=false: k1's gradient does not "
                      "depend on the teacher (verl refuses it too); use loss_mode=k3 (or use_policy_gradient=true)")
    if dl.distillation_loss_coef < 0:
        errors.append(f"{key}.distillation_loss_coef must be >= 0, got {dl.distillation_loss_coef}")
    if dl.loss_mode != "forward_kl_topk":
        return
    if dl.use_policy_gradient:
        errors.append(f"{key}.loss_mode=forward_kl_topk is a loss over the teacher's top tokens, not a per-token "
                      "advantage: set use_policy_gradient=false")
    if dl.topk < 1:
        errors.append(f"{key}.topk must be >= 1, got {dl.topk}")
    engines = [n for n, t in teachers.items() if t.backend != "megatron"]
    if engines:
        errors.append(f"{key}.loss_mode=forward_kl_topk needs teachers in megatron (their logits); {engines} run on "
                      "an engine, which answers log-probs of the sampled tokens only: set their backend=megatron")
    if refusal := per_position_topk_refusal(cfg.actor_rollout_ref.actor.megatron):
        errors.append(f"{key}.loss_mode=forward_kl_topk {refusal}")


def teacher_model_problems(cfg, tp: int, pp: int) -> list[str]:
    """Preflight, with the files: each megatron teacher's heads divide the tensor-parallel size and its layers the
    pipeline stages, its vocabulary is the student's (one tokenizer: the teacher reads the student's token ids),
    and an SGLang teacher's servers can start."""
    out = []
    student = _config_json(cfg.actor_rollout_ref.model.path)
    for name, t in teacher_configs(cfg).items():
        hf = _config_json(t.model_path)
        if hf is None or student is None:
            continue
        key = f"{KEY}.teacher_model" if name == "teacher" else f"{KEY}.teacher_models.{name}"
        if hf.get("vocab_size") != student.get("vocab_size"):
            out.append(f"{key}: the teacher's vocabulary ({hf.get('vocab_size')} tokens) is not the student's "
                       f"({student.get('vocab_size')}); on-policy distillation needs one tokenizer")
        heads, layers = hf.get("num_attention_heads", 1), hf.get("num_hidden_layers", 1)
        if t.backend == "megatron" and heads % tp:
            out.append(f"{key}: the teacher's {heads} attention heads do not divide over tensor_model_parallel_size="
                       f"{tp}; use a TP size that divides them, or backend=engine (its own layout)")
        if t.backend == "megatron" and layers % pp:
            out.append(f"{key}: the teacher's {layers} layers do not split into pipeline_model_parallel_size={pp} "
                       "stages; use a PP size that divides them, or backend=engine (its own layout)")
    return out + _engine_problems(cfg)


def _engine_problems(cfg) -> list[str]:
    """An engine teacher on another engine than the policy's must be able to start: that engine's preflight, with
    the policy's server python (the policy's own engine is checked by the policy's preflight)."""
    import copy

    from megappo.rollout.registry import preflight

    policy, out = cfg.actor_rollout_ref.rollout.name, []
    for t in teacher_configs(cfg).values():
        name = t.inference.name or policy
        if t.backend != "engine" or name == policy:
            continue
        probe = copy.deepcopy(cfg)
        r = probe.actor_rollout_ref.rollout
        r.name, r.mode, r.server_urls = name, None, list(t.inference.server_urls)
        out += [p.replace(f"actor_rollout_ref.rollout.name: {name} servers", f"a distillation teacher's {name} servers")
                .replace("actor_rollout_ref.rollout.name=hf", f"{KEY}.teacher_model.inference.name=hf")
                for p in preflight(probe)]
    return list(dict.fromkeys(out))


def _config_json(path) -> Any:
    try:
        with open(os.path.join(os.path.expanduser(path), "config.json"), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError, TypeError):
        return None
