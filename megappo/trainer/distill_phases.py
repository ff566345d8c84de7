"""The two phases on-policy distillation adds to a step (`megappo.trainer.loop.train_step`): the teachers' log-probs
of the student's tokens, after the student's own (old) log-probs; and the teacher's signal in the advantages, after
the estimator's. Every rank calls both (SPMD); the math is `megappo.algos.distillation`'s, the teachers are
`megappo.trainer.teachers`."""
from __future__ import annotations

import torch

from megappo.algos import distillation as math
from megappo.trainer.dp import masked_mean_dp
from megappo.trainer.experience import Experience
from megappo.trainer.state import Run


def teacher_log_probs(run: Run, exp: Experience) -> dict[str, float]:
    """exp.train.teacher_log_probs [B, R] (and the top-k pair [B, R, K] for top-k distillation), each row from the
    teacher of its data source; a row no teacher scores gets the student's own log-probs (no signal). Metrics:
    distill/reverse_kl (the token mean of log pi_student - log pi_teacher over the step), per teacher
    distill/<name>/reverse_kl, distill/teacher_log_prob_mean, distill/untaught_fraction."""
    teachers, t, mask = run.teachers, exp.train, exp.mask
    scores, route = teachers.score(run, exp.batch, exp.data_sources)
    taught = (route >= 0).unsqueeze(1)  # [B, 1]
    t.teacher_log_probs = torch.where(taught, scores.log_probs, t.old_log_probs)
    if teachers.topk:
        t.teacher_topk_log_probs = torch.where(taught.unsqueeze(-1), scores.topk_log_probs,
                                               torch.full((), float("-inf")))
        t.teacher_topk_ids = scores.topk_ids
    k1 = t.old_log_probs - t.teacher_log_probs
    taught_mask = mask * taught.to(mask.dtype)
    out = {"distill/reverse_kl": masked_mean_dp(k1, taught_mask, run.ps),
           "distill/teacher_log_prob_mean": masked_mean_dp(t.teacher_log_probs, taught_mask, run.ps),
           "distill/untaught_fraction": masked_mean_dp((~taught).to(mask.dtype).expand_as(mask), mask, run.ps)}
    for k, name in enumerate(teachers.names):
        rows = (route == k).unsqueeze(1).to(mask.dtype)
        out[f"distill/{name}/reverse_kl"] = masked_mean_dp(k1, mask * rows, run.ps)
    return out


def distill_advantages(run: Run, exp: Experience) -> dict[str, float]:
    """With use_policy_gradient, the advantages become task advantages - coef * divergence (or -divergence
    without use_task_rewards); as a loss term instead (the actor loss adds it), without use_task_rewards the task
    advantages are zeroed so that the teacher alone teaches. Metric: distill/divergence_mean, the configured
    estimator's token mean (what the advantage or the loss subtracts)."""
    dl, t, mask = run.cfg.distillation.distillation_loss, exp.train, exp.mask
    if dl.loss_mode in math.TOPK_MODES:  # a loss term only (checked): its value is the actor's distill_loss
        if not dl.use_task_rewards:
            t.advantages = torch.zeros_like(t.advantages)
        return {}
    div = math.token_divergence(t.old_log_probs, t.teacher_log_probs, dl.loss_mode,
                                log_prob_min_clamp=dl.log_prob_min_clamp, loss_max_clamp=dl.loss_max_clamp)
    if dl.use_policy_gradient:
        task = t.advantages if dl.use_task_rewards else None
        t.advantages = math.distill_advantages(task, div, mask, coef=dl.distillation_loss_coef)
    elif not dl.use_task_rewards:
        t.advantages = torch.zeros_like(t.advantages)
    return {"distill/divergence_mean": masked_mean_dp(div, mask, run.ps)}
