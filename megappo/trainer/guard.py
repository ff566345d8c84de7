"""The KL guard: the tuning guide's rules for a policy that moves too far in one step, automated.

- Early stop: a step's remaining PPO epochs are skipped once an epoch's `actor/ppo_kl` passes `epoch_kl_stop`.
- Rollback: a step whose `kl_metric` passes `kl_threshold`, or whose losses or gradient norms are NaN/Inf, is undone
  (fit restores the last good checkpoint: every checkpoint is good, as a step is checked before it is saved), and
  the next tries run with the actor's learning rate, the KL coefficient and the clip ratio scaled. The scales are
  part of the run's state: they are checkpointed, survive a resume and are never undone by a rollback.
- After `max_retries` rollbacks without getting past the tripped step, the run stops (RunStopped) and names its
  last good checkpoint.

Pure bookkeeping plus `apply`, which sets the scaled values on the run's optimizer, KL controller and loss.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Optional

from megappo.config.schema import GuardConfig
from megappo.models.losses import actor_loss_fn
from megappo.trainer import settings


class RunStopped(RuntimeError):
    """The trainer ended the run on purpose (KL guard out of retries, a failing reward function); the message says
    why and what to change. `megappo train` prints it without a traceback and exits with EXIT_STOPPED."""


EXIT_STOPPED = 3

# a step's numbers that must be finite for it to count as good
FINITE_KEYS = ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm")


@dataclass
class GuardState:
    lr_scale: float = 1.0  # actor learning rate multiplier
    kl_scale: float = 1.0  # kl_coef (in reward) and kl_loss_coef multiplier
    clip_scale: float = 1.0  # clip_ratio_low/high multiplier
    rollbacks: int = 0  # over the whole run
    retries: int = 0  # rollbacks since the run last got past a tripped step
    tripped_at: int = 0  # the step that tripped last (0: none)


class KLGuard:
    def __init__(self, cfg: GuardConfig, *, can_roll_back: bool):
        self.cfg = cfg
        self.can_roll_back = can_roll_back  # the run saves checkpoints
        self.state = GuardState()
        self._base_lrs: list[tuple[float, float]] = []  # each actor param group's (max_lr, min_lr) as built
        self._base_scheduler: tuple[float, float, float] = (0.0, 0.0, 0.0)

    @property
    def epoch_kl_stop(self) -> Optional[float]:
        return self.cfg.epoch_kl_stop if self.cfg.enable else None

    def check(self, metrics: dict[str, float], step: int) -> Optional[str]:
        """Why this step must be undone (None: it is good)."""
        if not self.cfg.enable:
            return None
        bad = [k for k in FINITE_KEYS if k in metrics and not math.isfinite(metrics[k])]
        if metrics.get("actor/update_skipped", 0.0) > 0 or metrics.get("critic/update_skipped", 0.0) > 0:
            bad.append("update_skipped (non-finite gradient)")
        if bad:
            return "non-finite " + ", ".join(bad)
        kl = metrics.get(self.cfg.kl_metric)
        if kl is not None and kl > self.cfg.kl_threshold:
            return f"{self.cfg.kl_metric}={kl:.4g} > trainer.guard.kl_threshold={self.cfg.kl_threshold}"
        if step > self.state.tripped_at:
            self.state.retries = 0  # past the trouble
        return None

    def plan_rollback(self, step: int, reason: str, last_good: Optional[str]) -> None:
        """Count a rollback of `step` and scale the settings for the retry; raise RunStopped when there is nothing
        to roll back to or the retries are used up."""
        s = self.state
        if not self.can_roll_back or last_good is None:
            raise RunStopped(f"the KL guard stopped the run at step {step}: {reason}. There is no checkpoint to roll "
                             "back to: set trainer.save_freq (the guard then also saves step 0), or lower "
                             "actor_rollout_ref.actor.optim.lr")
        if s.retries >= self.cfg.max_retries:
            raise RunStopped(
                f"the KL guard stopped the run at step {step}: {reason}, still after {s.retries} rollbacks "
                f"(lr x{s.lr_scale:.3g}, kl_coef x{s.kl_scale:.3g}, clip_ratio x{s.clip_scale:.3g}). The last good "
                f"checkpoint is {last_good}. Lower actor_rollout_ref.actor.optim.lr or raise the KL coefficient and "
                "start again (resume_mode=auto continues from it), or raise trainer.guard.max_retries")
        s.retries += 1
        s.rollbacks += 1
        s.tripped_at = max(s.tripped_at, step)
        s.lr_scale *= self.cfg.lr_factor
        s.kl_scale *= self.cfg.kl_coef_factor
        s.clip_scale *= self.cfg.clip_ratio_factor

    def metrics(self) -> dict[str, float]:
        s = self.state
        return {"guard/lr_scale": s.lr_scale, "guard/kl_coef_scale": s.kl_scale, "guard/clip_ratio_scale": s.clip_scale,
                "guard/rollbacks": float(s.rollbacks)}

    # --------------------------------------------------------------------------------------------------------------
    # state
    # --------------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return asdict(self.state)

    def load_state_dict(self, state: Optional[dict]) -> None:
        self.state = GuardState(**(state or {}))

    # --------------------------------------------------------------------------------------------------------------
    # applying the scales
    # --------------------------------------------------------------------------------------------------------------
    def remember_base(self, run: Any) -> None:
        """Record the actor's learning rates as built, before anything loads or scales them."""
        opt, sched = run.roles.actor.optimizer, run.roles.actor.scheduler
        self._base_lrs = [(g.get("max_lr", sched.max_lr), g.get("min_lr", sched.min_lr)) for g in opt.param_groups]
        self._base_scheduler = (sched.max_lr, sched.min_lr, sched.init_lr)

    def apply(self, run: Any, scale_of_restored_kl: float = 1.0) -> None:
        """Put the scales into effect after setup, a resume or a rollback. The learning rates and the loss are set
        from their built values; the KL controller, whose value moves (adaptive), is rescaled from the value just
        restored, which was saved under `scale_of_restored_kl`."""
        s, sched = self.state, run.roles.actor.scheduler
        # by position: loading an optimizer state replaces the param group dicts
        for group, (max_lr, min_lr) in zip(run.roles.actor.optimizer.param_groups, self._base_lrs, strict=True):
            group["max_lr"], group["min_lr"] = max_lr * s.lr_scale, min_lr * s.lr_scale
        max_lr, min_lr, init_lr = self._base_scheduler
        sched.max_lr, sched.min_lr, sched.init_lr = max_lr * s.lr_scale, min_lr * s.lr_scale, init_lr * s.lr_scale
        sched.step(0)  # recompute the param groups' current lr
        run.kl_ctrl.value *= s.kl_scale / scale_of_restored_kl
        base = settings.actor_loss(run.cfg)
        run.actor_loss = actor_loss_fn(replace(base, clip_low=base.clip_low * s.clip_scale,
                                               clip_high=base.clip_high * s.clip_scale,
                                               kl_loss_coef=base.kl_loss_coef * s.kl_scale))
