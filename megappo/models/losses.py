"""The PPO loss closures that `compute.train_step` runs on each micro-batch: the actor's and the critic's.

They turn a micro-batch's model outputs and its `TrainInputs` into the micro-batch's share of the mini-batch loss by
calling `megappo.algos` with plain numbers and the mini-batch's *global* token and sequence counts (over every
micro-batch and data-parallel rank), so the sum of the shares is the mini-batch loss however it was split. The
settings are plain dataclasses; `megappo.trainer.settings` is the one place config names map onto them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from megappo import algos
from megappo.algos import distillation
from megappo.algos.policy_losses import PolicyLossParams, get_policy_loss
from megappo.algos.rollout_correction import RolloutCorrection, bypass_policy_loss
from megappo.models.compute import LossFn, MicroBatchContext, ModelOutputs


@dataclass(frozen=True)
class ActorLossSettings:
    clip_low: float = 0.2  # ratio clipped below at 1 - clip_low
    clip_high: float = 0.2  # and above at 1 + clip_high
    clip_c: Optional[float] = 3.0  # dual-clip bound for negative advantages (None: off)
    agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0  # loss -= entropy_coeff * entropy
    use_kl_loss: bool = False  # loss += kl_loss_coef * KL(actor || ref)
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"
    # algorithm.rollout_correction with bypass_mode: old log-probs are the rollout's and the correction (IS weights,
    # rejection) runs here, per micro-batch, with the current policy's detached log-probs as old
    bypass: Optional[RolloutCorrection] = None
    loss_mode: str = "vanilla"  # a name of megappo.algos.policy_losses
    loss_params: PolicyLossParams = PolicyLossParams()  # the mode's own settings (clip ratios copied in)
    custom_loss: tuple[Optional[str], Optional[str]] = (None, None)  # a user's loss: (file, function name)
    # seq-mean-token-sum-norm's divisor: a constant (loss_scale_factor or the response length limit), so every
    # micro-batch, whatever its own padded length, divides by the same number
    norm_length: Optional[float] = None
    distill: Optional["DistillLossSettings"] = None  # a distillation loss term (None: none)


@dataclass(frozen=True)
class DistillLossSettings:
    """On-policy distillation as a loss term (distillation.distillation_loss.use_policy_gradient false)."""

    mode: str  # a megappo.algos.distillation divergence: k3, k2, ... or forward_kl_topk
    coef: float  # loss += coef * the aggregated divergence
    log_prob_min_clamp: Optional[float] = None
    loss_max_clamp: Optional[float] = None


@dataclass(frozen=True)
class CriticLossSettings:
    clip_range: Optional[float] = 0.5  # values clipped to old +- clip_range (None: plain MSE)
    agg_mode: str = "token-mean"
    norm_length: Optional[float] = None


def _agg(x: torch.Tensor, mask: torch.Tensor, mode: str, ctx: MicroBatchContext,
         norm_length: Optional[float] = None) -> torch.Tensor:
    return algos.aggregate_loss(x, mask, mode, num_tokens=ctx.global_num_tokens, num_seqs=ctx.global_num_seqs,
                                norm_length=norm_length)


def _token_share(mask: torch.Tensor, ctx: MicroBatchContext) -> float:
    """This micro-batch's fraction of the mini-batch's response tokens: a token mean times it is its share."""
    return float(mask.sum()) / max(ctx.global_num_tokens, 1)


def actor_loss_fn(s: ActorLossSettings) -> LossFn:
    """Clipped (and dual-clip) surrogate + optional KL loss - entropy bonus. Needs log-probs and entropy
    (`train_step(..., calculate_entropy=True)`) and train inputs old_log_probs, advantages (and ref_log_probs;
    rollout_is_weights when algorithm.rollout_correction.rollout_is multiplies each token's loss).
    Metrics (shares, see `train_step`): pg_loss, pg_clipfrac, pg_clipfrac_lower, ppo_kl, entropy, kl_loss,
    distill_loss (with a distillation loss term: train inputs teacher_log_probs or the top-k pair); with
    bypass_mode also the micro-batches' rollout_corr/* diagnostics."""

    pg = get_policy_loss(s.loss_mode, *s.custom_loss)
    params = replace(s.loss_params, clip_low=s.clip_low, clip_high=s.clip_high, clip_c=s.clip_c,
                     norm_length=s.norm_length)

    def loss_fn(out: ModelOutputs, ctx: MicroBatchContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        t, mask = ctx.batch.train, ctx.batch.response_mask
        counts = {"num_tokens": ctx.global_num_tokens, "num_seqs": ctx.global_num_seqs}
        if s.bypass is not None:
            pg_loss, pg_metrics = bypass_policy_loss(
                out.log_probs, t.old_log_probs, t.advantages, mask, s.bypass, clip_low=s.clip_low,
                clip_high=s.clip_high, clip_c=s.clip_c, agg_mode=s.agg_mode, norm_length=s.norm_length, **counts)
            pg_metrics = {k: torch.as_tensor(v) for k, v in pg_metrics.items()}
        else:
            pg_loss, pg_metrics = pg(out.log_probs, t.old_log_probs, t.advantages, mask, params, agg_mode=s.agg_mode,
                                     is_weights=_token_weights(t), **counts)
        share = _token_share(mask, ctx)
        metrics = {k: v * share for k, v in pg_metrics.items()}  # token means within the micro-batch
        metrics["pg_loss"] = pg_loss.detach()
        loss = pg_loss
        if out.entropy is not None:
            entropy = _agg(out.entropy, mask, s.agg_mode, ctx, s.norm_length)
            metrics["entropy"] = entropy.detach()
            if s.entropy_coeff:
                loss = loss - s.entropy_coeff * entropy
        if s.use_kl_loss:
            kl_loss = _agg(algos.kl_penalty(out.log_probs, t.ref_log_probs, s.kl_loss_type), mask, s.agg_mode, ctx,
                           s.norm_length)
            loss = loss + s.kl_loss_coef * kl_loss
            metrics["kl_loss"] = kl_loss.detach()
        if s.distill is not None:
            distill_loss = _agg(_divergence(s.distill, out, t), mask, s.agg_mode, ctx, s.norm_length)
            loss = loss + s.distill.coef * distill_loss
            metrics["distill_loss"] = distill_loss.detach()
        return loss, metrics

    return loss_fn


def _token_weights(t) -> Optional[torch.Tensor]:
    """[b, r] what multiplies each token's policy loss: the rollout correction's weights and the tokens chosen
    for the policy gradient (a token left out keeps its place in the normaliser), or None for all ones."""
    w, chosen = t.rollout_is_weights, t.pg_token_mask
    if chosen is None:
        return w
    return chosen if w is None else w * chosen


def _divergence(d: DistillLossSettings, out: ModelOutputs, t) -> torch.Tensor:
    """[b, r] the student's divergence from the teacher, differentiable in the student's log-probs."""
    if d.mode in distillation.TOPK_MODES:
        return distillation.forward_kl_topk(out.topk_log_probs, t.teacher_topk_log_probs,
                                            loss_max_clamp=d.loss_max_clamp)
    return distillation.token_divergence(out.log_probs, t.teacher_log_probs, d.mode,
                                         log_prob_min_clamp=d.log_prob_min_clamp, loss_max_clamp=d.loss_max_clamp)


def critic_loss_fn(s: CriticLossSettings) -> LossFn:
    """Clipped value loss against the returns. Needs values and train inputs values (old) and returns.
    Metrics (shares): vf_loss, vf_clipfrac."""

    def loss_fn(out: ModelOutputs, ctx: MicroBatchContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        t, mask = ctx.batch.train, ctx.batch.response_mask
        loss, metrics = algos.value_loss(
            out.values, t.values, t.returns, mask, clip_range=s.clip_range, agg_mode=s.agg_mode,
            num_tokens=ctx.global_num_tokens, num_seqs=ctx.global_num_seqs, norm_length=s.norm_length,
        )
        return loss, {"vf_loss": loss.detach(), "vf_clipfrac": metrics["vf_clipfrac"] * _token_share(mask, ctx)}

    return loss_fn
