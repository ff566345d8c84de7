"""On-policy distillation's math: per-token divergences between a student and a teacher on the student's own
tokens, the advantage they make, and the top-k forward KL. Tensors in, tensors and metrics out; no process groups,
no models, no config objects.

Shapes: B samples, R response tokens, K top-k entries. `mask` [B, R] is 1 on the tokens trained on.
"""
from __future__ import annotations

from typing import Optional

import torch

from megappo.algos import kl_penalty

TOPK_MODES = ("forward_kl_topk",)


def token_divergence(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, mode: str, *,
                     log_prob_min_clamp: Optional[float] = None, loss_max_clamp: Optional[float] = None
                     ) -> torch.Tensor:
    """[B, R] per-token estimate of KL(student || teacher) from the sampled tokens' log-probs [B, R] (verl's
    distillation loss modes): k1 = log pi_s - log pi_t (the sampled reverse KL, unbiased, signed), k3/low_var_kl
    (>= 0, lower variance), k2/mse, abs. Log-probs are clamped below at `log_prob_min_clamp` first (a teacher's
    near-zero probability would otherwise dominate), the result to [-loss_max_clamp, loss_max_clamp]."""
    if log_prob_min_clamp is not None:
        student_log_probs = student_log_probs.clamp(min=log_prob_min_clamp)
        teacher_log_probs = teacher_log_probs.clamp(min=log_prob_min_clamp)
    out = kl_penalty(student_log_probs, teacher_log_probs, mode)
    if loss_max_clamp is not None:
        out = out.clamp(min=-loss_max_clamp, max=loss_max_clamp)
    return out


def forward_kl_topk(student_topk_log_probs: torch.Tensor, teacher_topk_log_probs: torch.Tensor, *,
                    loss_max_clamp: Optional[float] = None) -> torch.Tensor:
    """[B, R] KL(teacher || student) over the teacher's top-k tokens at each position: sum_k p_t(k) (log p_t(k) -
    log p_s(k)), with both log-probs [B, R, K] of the full vocabulary's softmax at the same token ids (the mass
    outside the top k is left out, as verl and NeMo-RL do; a row whose teacher entries are -inf adds 0).
    Differentiable in the student's."""
    p_t = teacher_topk_log_probs.exp()
    terms = p_t * (teacher_topk_log_probs - student_topk_log_probs)
    out = torch.where(p_t > 0, terms, torch.zeros((), dtype=terms.dtype)).sum(-1)  # a -inf teacher entry adds 0
    if loss_max_clamp is not None:
        out = out.clamp(max=loss_max_clamp)
    return out


def distill_advantages(task_advantages: Optional[torch.Tensor], divergence: torch.Tensor, mask: torch.Tensor, *,
                       coef: float) -> torch.Tensor:
    """[B, R] advantages with the teacher's signal: task_advantages - coef * divergence (Thinking Machines'
    on-policy distillation, slime's OPD, verl's use_policy_gradient), the divergence detached and unwhitened (its
    absolute size is the signal); without task advantages (None) just -divergence. Zero off the mask."""
    signal = -divergence.detach()
    if task_advantages is not None:
        signal = task_advantages + coef * signal
    return signal * mask
