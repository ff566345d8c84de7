"""The PPO trainer: `fit(cfg)` runs KL-regularized PPO (or GRPO) end to end, SPMD under torchrun."""


def fit(cfg):  # noqa: D103 - documented in megappo.trainer.loop
    from megappo.trainer.loop import fit as _fit

    return _fit(cfg)


__all__ = ["fit"]
