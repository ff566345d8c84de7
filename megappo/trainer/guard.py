"""The KL guard: the tuning guide's rules for a policy that moves too far in one step, automated.

- Early stop: a step's remaining PPO epochs are skipped once an epoch's `actor/ppo_kl` passes `epoch_kl_stop`.
- Rollback: a step whose `kl_metric` passes `kl_threshold`, or whose losses or gradient norms are NaN/Inf, is undone
  (fit restores the last good checkpoint: every checkpoint is good, as a step is checked before it is saved), and
  the next tries run with the actor's learning rate, the KL coefficient and the clip ratio scaled. The scales are
  part of the run's state: they are checkpointed, survive a resume and are never undone by a rollback.
- After `max_retries` rollbacks without getting past the tripped step, the run stops (RunStopped) and names its
  last good checkpoint.

Pure bookkeeping: `scales()` says what to scale, and their owners apply them (`build.apply_guard_scales`: the
actor's learning rates, the KL controller, the actor loss).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

from megappo.config.schema import GuardConfig
from megappo.platform.exits import RunStopped

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


@dataclass(frozen=True)
class Scales:
    """Multipliers of the settings as configured."""

    lr: float = 1.0  # the actor's learning rate (max and min of every param group and of the schedule)
    kl: float = 1.0  # the KL coefficient: kl_ctrl (in the reward) and kl_loss_coef (as a loss)
    clip: float = 1.0  # the clip ratio, low and high


class KLGuard:
    def __init__(self, cfg: GuardConfig, *, can_roll_back: bool):
        self.cfg = cfg
        self.can_roll_back = can_roll_back  # the run saves checkpoints
        self.state = GuardState()

    def scales(self) -> Scales:
        s = self.state
        return Scales(lr=s.lr_scale, kl=s.kl_scale, clip=s.clip_scale)

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
