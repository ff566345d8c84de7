"""A policy loss with a coefficient of its own, added from outside megappo's loss file: its settings class and its
config rule register with it, its key is read from the config by name, and both the config's validation and the
trainer's loss use them (docs/adding-to-megappo.md's newcomer's table)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from megappo.algos import policy_losses as pl
from megappo.checks import rule_errors
from megappo.config import load_config
from megappo.config.schema.actor import PolicyLossConfig
from megappo.models.batch import ModelBatch, TrainInputs
from megappo.models.compute import MicroBatchContext, ModelOutputs
from megappo.models.losses import actor_loss_fn
from megappo.trainer.settings import actor_loss

NAME = "scaled_vanilla_test"
KEY = "actor_rollout_ref.actor.policy_loss.pg_scale"


@dataclass(frozen=True)
class ScaledParams(pl.PolicyLossParams):
    pg_scale: Optional[float] = None


@dataclass
class ScaledLossConfig(PolicyLossConfig):  # the schema's new key, as PolicyLossConfig would hold it
    pg_scale: Optional[float] = None


def pg_scale_refusal(p: ScaledParams) -> Optional[str]:
    return None if p.pg_scale and p.pg_scale > 0 else f"{KEY}: is {p.pg_scale}; set a positive scale"


@pytest.fixture
def scaled_loss():
    @pl.register_policy_loss(NAME, params=ScaledParams, check=pg_scale_refusal)
    def scaled(log_probs, old_log_probs, advantages, mask, p: ScaledParams, **kw):
        loss, metrics = pl.POLICY_LOSSES["vanilla"](log_probs, old_log_probs, advantages, mask, p, **kw)
        return p.pg_scale * loss, metrics

    yield scaled
    for table in (pl.POLICY_LOSSES, pl.LOSS_PARAMS, pl.LOSS_CHECKS):
        table.pop(NAME)


def _config(pg_scale):
    cfg = load_config(None, ["actor_rollout_ref.model.path=/models/m"])
    a = cfg.actor_rollout_ref.actor
    a.policy_loss = ScaledLossConfig(**{**dataclasses.asdict(a.policy_loss), "loss_mode": NAME,
                                        "pg_scale": pg_scale})
    return cfg


def test_a_registered_loss_gets_its_coefficient_by_name_and_its_rule_is_asked(scaled_loss):
    assert f"{KEY}: is None; set a positive scale" in rule_errors(_config(None), 8, check_files=False)
    assert not any(KEY in e for e in rule_errors(_config(2.5), 8, check_files=False))

    settings = actor_loss(_config(2.5))
    assert isinstance(settings.loss_params, ScaledParams) and settings.loss_params.pg_scale == 2.5
    g = torch.Generator().manual_seed(0)
    b, r = 3, 4
    mask = torch.ones(b, r)
    logp, old, adv = (torch.randn(b, r, generator=g) for _ in range(3))
    batch = ModelBatch(torch.zeros(b, r + 1, dtype=torch.long), torch.ones(b, r + 1, dtype=torch.long),
                       torch.zeros(b, r + 1, dtype=torch.long), mask, TrainInputs(old_log_probs=old, advantages=adv))
    ctx = MicroBatchContext(batch, b * r, b, 0, 1)
    loss, metrics = actor_loss_fn(settings)(ModelOutputs(log_probs=logp), ctx)
    plain = dataclasses.replace(settings, loss_mode="vanilla", loss_params=pl.PolicyLossParams())
    want, _ = actor_loss_fn(plain)(ModelOutputs(log_probs=logp), ctx)
    torch.testing.assert_close(loss, 2.5 * want)


def test_the_built_in_losses_read_their_settings_by_name():
    cfg = load_config(None, ["actor_rollout_ref.model.path=/models/m",
                             "actor_rollout_ref.actor.policy_loss.loss_mode=dro",
                             "actor_rollout_ref.actor.policy_loss.dro_beta=0.3", "actor_rollout_ref.actor.tau_neg=1.2",
                             "actor_rollout_ref.actor.entropy_coeff=0.01"])
    s = actor_loss(cfg)
    assert (s.loss_params.dro_beta, s.loss_params.tau_neg, s.entropy_coeff) == (0.3, 1.2, 0.01)
    assert pl.loss_refusal("dro", dataclasses.replace(s.loss_params, dro_beta=None)).startswith(
        "actor_rollout_ref.actor.policy_loss.dro_beta: is None")
