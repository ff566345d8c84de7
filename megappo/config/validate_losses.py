"""The rules of the policy loss's token choice (actor.policy_loss.top_entropy_quantile), called by
`megappo.config.validate`: each message names the key, what is wrong and the fix."""
from __future__ import annotations

from megappo.config.fields import need
from megappo.config.schema import MegappoConfig


def token_choice_errors(cfg: MegappoConfig) -> list[str]:
    key, errors = "actor_rollout_ref.actor.policy_loss.top_entropy_quantile", []
    pl, bypass = cfg.actor_rollout_ref.actor.policy_loss, cfg.algorithm.rollout_correction.bypass_mode
    q = pl.top_entropy_quantile
    need(errors, 0 < q <= 1, key, f"must be in (0, 1], got {q}",
         "use e.g. 0.2 for the top 20% of tokens by entropy, or 1.0 for all")
    if q < 1:
        need(errors, pl.loss_mode != "geo_mean", key, f"is {q} but loss_mode=geo_mean makes one term of each "
             "response (its ratios' geometric mean), so no token can be left out",
             "use 1.0 with geo_mean, or a token-level loss_mode such as vanilla")
        need(errors, not bypass, key, f"is {q} but tokens are chosen by the old policy's entropy, from the old "
             "log-prob forward that algorithm.rollout_correction.bypass_mode skips",
             "use 1.0 with bypass_mode, or bypass_mode=false")
    return errors
