"""A user's own advantage estimator and policy loss, registered from this file by name (docs/algorithms.md):

    megappo train --config recipes/cpu/tiny_grpo.yaml \
        algorithm.adv_estimator=median_baseline \
        algorithm.custom_adv_estimator.path=recipes/custom_algos.py algorithm.custom_adv_estimator.name=median_baseline \
        actor_rollout_ref.actor.policy_loss.loss_mode=clipped_pg \
        actor_rollout_ref.actor.policy_loss.path=recipes/custom_algos.py \
        actor_rollout_ref.actor.policy_loss.name=clipped_pg
"""
import torch

from megappo.algos import aggregate_loss, masked_mean
from megappo.algos.estimators import adv_estimator


@adv_estimator("outcome", needs_groups=True)
def median_baseline(scores, group_ids, lengths, params):
    """scores, group_ids, lengths: [N] for the whole step -> advantages [N]: score - its prompt's median score."""
    adv = torch.zeros_like(scores)
    for g in group_ids.unique():
        rows = group_ids == g
        adv[rows] = scores[rows] - scores[rows].median()
    return adv


def clipped_pg(log_probs, old_log_probs, advantages, mask, params, *, agg_mode, num_tokens=None, num_seqs=None,
               is_weights=None):
    """[B, T] tensors -> (loss, metrics): REINFORCE on log-probs, weighted by the ratio clipped to [1-low, 1+high]."""
    m = mask.bool()
    log_ratio = torch.where(m, log_probs - old_log_probs, torch.zeros_like(log_probs))
    weight = torch.exp(log_ratio).clamp(1 - params.clip_low, 1 + params.clip_high).detach()
    losses = -weight * torch.where(m, advantages * log_probs, torch.zeros_like(log_probs))
    if is_weights is not None:
        losses = losses * is_weights
    loss = aggregate_loss(losses, m, agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, norm_length=params.norm_length)
    return loss, {"ppo_kl": masked_mean(-log_ratio, m).detach()}
