"""The run's distillation teachers, built once at setup: each a frozen model that scores the student's own tokens,
in megatron beside the reference (`MegatronTeacher`: the actor's parallel layout, offloaded between uses on GPU) or
on an engine of its own (`EngineTeacher`: `megappo.rollout.fixed`, the policy rollout's machinery with the teacher's
model, never synced). `Teachers` routes each sample to its teacher by data source and asks each for its rows.

Every method is collective over the ranks of the run (SPMD), as the phases that call them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from megappo.distill.checks import TeacherSpec, teacher_specs
from megappo.models.batch import ModelBatch
from megappo.models.compute import compute_log_probs, compute_topk_log_probs


@dataclass
class TeacherScores:
    log_probs: torch.Tensor  # [b, R] the teacher's log-probs of the response tokens (0 on padding)
    topk_log_probs: Optional[torch.Tensor] = None  # [b, R, K] its top-k tokens' log-probs (top-k distillation)
    topk_ids: Optional[torch.Tensor] = None  # [b, R, K] long, those tokens


class MegatronTeacher:
    def __init__(self, spec: TeacherSpec, role: Any):
        self.spec, self.role = spec, role

    def score(self, run: Any, batch: ModelBatch, topk: int) -> TeacherScores:
        from megappo.trainer.roles import on_device

        kw = dict(parallel_state=run.ps, micro=run.batching.ref_log_prob, temperature=run.sampling.logprob_temperature)
        with on_device(self.role, run.platform):
            if topk:
                return TeacherScores(*compute_topk_log_probs(self.role.chunks, batch, topk, **kw))
            return TeacherScores(compute_log_probs(self.role.chunks, batch, **kw)[0])

    def close(self) -> None:
        pass


class EngineTeacher:
    """The model-parallel group's first rank asks its engine for the rows' log-probs (prompt and response as one
    sequence) and sends them to the rest of the group."""

    def __init__(self, spec: TeacherSpec, deployment: Any):
        self.spec, self.deployment = spec, deployment

    def score(self, run: Any, batch: ModelBatch, topk: int) -> TeacherScores:
        out = torch.zeros(batch.response_mask.shape, dtype=torch.float32)
        engine = self.deployment.engine
        if engine is not None:
            p, plens = batch.prompt_len, batch.prompt_lengths().tolist()
            rlens = batch.attention_mask[:, p:].sum(-1).tolist()
            seqs = [batch.input_ids[i, p - int(pl):p + int(rl)].tolist() for i, (pl, rl) in
                    enumerate(zip(plens, rlens))]
            for i, (lp, rl) in enumerate(zip(engine.sequence_log_probs(seqs), rlens)):
                if rl:
                    out[i, :int(rl)] = torch.tensor(lp[-int(rl):], dtype=torch.float32)
        ps = run.ps
        if dist.get_world_size(ps.mp_group) > 1:
            dist.broadcast(out, src=dist.get_global_rank(ps.mp_group, 0), group=ps.mp_group)
        return TeacherScores(out * batch.response_mask.to(out.dtype))

    def close(self) -> None:
        self.deployment.close()


class Teachers:
    """The teachers and which data source each scores."""

    def __init__(self, teachers: list, topk: int):
        self.teachers, self.topk = teachers, topk
        named = {ds: k for k, t in enumerate(teachers) for ds in t.spec.data_sources}
        default = [k for k, t in enumerate(teachers) if not t.spec.data_sources]
        self._named, self._default = named, (default[0] if default else None)

    @property
    def names(self) -> list[str]:
        return [t.spec.name for t in self.teachers]

    def route(self, data_sources: list[str]) -> list[Optional[int]]:
        """Each row's teacher (its index; None: no teacher scores that data source)."""
        return [self._named.get(ds, self._default) for ds in data_sources]

    def score(self, run: Any, batch: ModelBatch, data_sources: list[str]) -> tuple[TeacherScores, torch.Tensor]:
        """Every row's scores from its teacher, and the [b] long route (-1: untaught; its log-probs are 0)."""
        route = torch.tensor([-1 if k is None else k for k in self.route(data_sources)], dtype=torch.long)
        b, r = batch.response_mask.shape
        out = TeacherScores(torch.zeros(b, r))
        if self.topk:
            out.topk_log_probs = torch.zeros(b, r, self.topk)
            out.topk_ids = torch.zeros(b, r, self.topk, dtype=torch.long)
        for k, teacher in enumerate(self.teachers):
            rows = (route == k).nonzero().squeeze(1)
            if rows.numel() == 0:  # the same rows on every rank of the model-parallel group: all skip it
                continue
            got = teacher.score(run, batch.select(rows), self.topk)
            out.log_probs[rows] = got.log_probs.to(out.log_probs.dtype)
            if self.topk:
                out.topk_log_probs[rows], out.topk_ids[rows] = got.topk_log_probs, got.topk_ids
        return out, route

    def describe(self, ps: Any) -> list[str]:
        """A line per teacher for the run's start-up summary."""
        from megappo.models.builder import model_config_summary

        out = []
        for t in self.teachers:
            sources = ", ".join(t.spec.data_sources) or "all no other teacher names"
            where = (model_config_summary(t.role.chunks, ps) if isinstance(t, MegatronTeacher) else
                     f"engine {t.spec.inference.name or 'as the rollout'} serving {t.spec.model_path}")
            out.append(f"teacher {t.spec.name} (data sources: {sources}): {where}")
        return out

    def close(self) -> None:
        for t in self.teachers:
            t.close()


def build_teachers(cfg: Any, ps: Any, platform: Any, policy_rollout: Any) -> Optional[Teachers]:
    """The run's teachers (None without distillation); collective. policy_rollout: the policy's `RolloutSettings`,
    which an engine teacher's `inference` section overrides."""
    if not cfg.distillation.enabled:
        return None
    from megappo.rollout import registry
    from megappo.rollout.fixed import fixed_settings
    from megappo.trainer.roles import frozen_role

    built: list = []
    try:
        for spec in teacher_specs(cfg):
            if spec.backend == "megatron":
                role = frozen_role("teacher", spec.model_path, ps, platform,
                                   cfg.actor_rollout_ref.actor.megatron.seed)
                built.append(MegatronTeacher(spec, role))
            else:
                settings = fixed_settings(policy_rollout, spec.model_path, spec.inference)
                built.append(EngineTeacher(spec, registry.deploy(settings, ps, platform)))
    except BaseException:
        for teacher in built:
            teacher.close()
        raise
    dl = cfg.distillation.distillation_loss
    return Teachers(built, dl.topk if dl.loss_mode == "forward_kl_topk" else 0)
