"""Faults injected around the trainer's real actor update (`phases.update_actor`), for tests of the KL guard,
skipped updates and checkpoints written after them."""
from __future__ import annotations

from megappo.trainer import phases


def inject_fault(monkeypatch, fault: str, at_step: int, times: int = 1) -> list[int]:
    """Make the first `times` actor updates of step `at_step` faulty (`fault`: "nan", a NaN actor loss, so every
    optimizer step of that update is skipped; "kl_spike", that update at 100000x the learning rate), through pytest's
    `monkeypatch`; returns the steps of all actor updates."""
    real = phases.update_actor
    seen: list[int] = []

    def update_actor(run, exp, step):
        seen.append(step)
        if step != at_step or seen.count(step) > times:
            return real(run, exp, step)
        if fault == "nan":
            good = run.actor_loss

            def nan_loss(out, ctx):
                loss, metrics = good(out, ctx)
                return loss * float("nan"), metrics
            run.actor_loss = nan_loss
            try:
                return real(run, exp, step)
            finally:
                run.actor_loss = good
        groups = run.roles.actor.optimizer.param_groups  # "spike": this update at 100000x the learning rate
        saved = [(g["max_lr"], g["min_lr"]) for g in groups]
        for g in groups:
            g["max_lr"], g["min_lr"] = g["max_lr"] * 100000, g["min_lr"] * 100000
        run.roles.actor.scheduler.step(0)
        try:
            return real(run, exp, step)
        finally:
            for g, (hi, lo) in zip(groups, saved):
                g["max_lr"], g["min_lr"] = hi, lo
            run.roles.actor.scheduler.step(0)

    monkeypatch.setattr(phases, "update_actor", update_actor)
    return seen
