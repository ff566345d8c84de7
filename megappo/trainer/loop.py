"""`fit(cfg)`: KL-regularized PPO (or GRPO), one named phase after another. Every rank runs it (SPMD)."""
from __future__ import annotations

import os
import traceback
from typing import Optional

from megappo.config.derived import estimator_needs
from megappo.config.schema import MegappoConfig
from megappo.platform.exits import RunStopped
from megappo.trainer import checkpointing, distill_phases as distill, dynamic_sampling, phases
from megappo.trainer.async_rollout import rollout_source
from megappo.trainer.build import rollback, setup, teardown
from megappo.trainer.dp import trains_on_nothing
from megappo.trainer.metrics import Timer
from megappo.trainer.preemption import EXIT_REQUEUE, StopRequest, write_status
from megappo.trainer.run_lock import AlreadyFinished
from megappo.trainer.rollout_source import RolloutSource
from megappo.trainer.state import Run


def fit(cfg: MegappoConfig) -> int:
    """Train; returns 0 when done, EXIT_REQUEUE when stopped by a signal or the deadline (after saving; or, when the
    step in progress fails after a signal, leaving the last checkpoint). Raises RunStopped when the KL guard or the
    reward watch ends the run."""
    run = state = stop = source = None
    try:
        run, state = setup(cfg)
        t = run.cfg.trainer
        stop = StopRequest(t.save_before_deadline)
        stop.install()  # after setup: ray.init and server launchers install handlers of their own
        # validation scores with the rule rewards (scored on rank 0, but every rank takes part)
        validates = state.val_loader is not None and not run.cfg.reward_model.enable
        if not state.resumed and t.val_before_train and validates:
            state.logger.log(0, phases.validate(run, state.val_loader))
        if not state.resumed and run.guard.cfg.enable and t.save_freq > 0:
            checkpointing.save(run, state.local_dir, 0, state.state_dict(), None)  # what a rollback returns to
        source = rollout_source(run, state)
        while state.step < state.total_steps:
            step = state.step + 1
            metrics = train_step(run, source, step, stop if step < state.total_steps else None)
            if reason := phases.guard_verdict(run, metrics, step):
                state.logger.log(step, metrics, rolled_back=True)
                source.close()  # the batch in flight is the undone policy's
                rollback(run, state, step, reason)
                state.logger.rolled_back_to(state.step)
                source = rollout_source(run, state)
                continue
            last = step == state.total_steps
            if validates and t.test_freq > 0 and (step % t.test_freq == 0 or last):
                metrics.update(phases.validate(run, state.val_loader))
            state.step = step
            state.logger.log(step, metrics)  # before the save: a resumed run keeps the rows up to its checkpoint
            saved = t.save_freq > 0 and (step % t.save_freq == 0 or last)
            timer = Timer()
            with timer("save"):
                if saved:
                    source.before_save()
                    checkpointing.save(run, state.local_dir, step, state.state_dict(), t.max_ckpt_to_keep)
            stop.timed(metrics["timing/step_s"], timer.seconds["save"])
            if not last and (why := stop.reason()):
                if not saved:
                    source.before_save()
                    checkpointing.save(run, state.local_dir, step, state.state_dict(), t.max_ckpt_to_keep)
                write_status(state.local_dir, "preempted", step, reason=why)
                return EXIT_REQUEUE
        checkpointing.export_actor(run, os.path.join(state.local_dir, "hf", "actor"))
        write_status(state.local_dir, "finished", state.step)
        return 0
    except AlreadyFinished:  # said by rank 0: nothing to train, nothing written
        return 0
    except RunStopped as e:
        if state is not None:
            write_status(state.local_dir, "stopped", state.step, reason=str(e))
        raise
    except Exception as e:
        if stop is None or stop.signal is None or state is None:
            raise
        # Slurm's preemption SIGTERM reaches every process of the job. The servers and reward workers this run
        # started ignore it (they stop when the run stops them), but a helper it did not start can die of it: the
        # servers of rollout.server_urls (a `megappo rollout-server` step stops its server on SIGTERM), a Ray
        # cluster it joined. Then the step in progress is lost, the last checkpoint stands, and the run is still
        # requeued as preempted rather than failed.
        traceback.print_exc()
        saved = checkpointing.latest_step(state.local_dir)
        write_status(state.local_dir, "preempted", state.step, checkpoint=saved,
                     reason=f"{stop.signal} received; then the run failed ({type(e).__name__}: {e}); it resumes "
                     + (f"from the checkpoint of step {saved}" if saved is not None else "from the start"))
        return EXIT_REQUEUE
    finally:
        if stop is not None:
            stop.uninstall()
        if source is not None:
            source.close()  # nothing in flight when the engines stop
        teardown(run, state)  # after a failed setup (run None): the process groups


def train_step(run: Run, source: RolloutSource, step: int, stop: Optional[StopRequest] = None) -> dict[str, float]:
    """One PPO step on the samples `source` gives for it; returns the step's metrics. A run that will stop after
    this step (`stop`, asked of every rank; None on the last step) does not sync the weights it is about to save
    (`RolloutWorker.skip_sync`)."""
    cfg, timer, m = run.cfg, Timer(), {}
    with timer("step"):
        # rollout and rule rewards; with algorithm.filter_groups, repeated until train_batch_size prompt groups
        # whose responses differ are kept (DAPO's dynamic sampling)
        scored = dynamic_sampling.rollout_and_score(run, source, step, timer)
        samples, reward_metrics = scored.samples, scored.reward_metrics
        m.update(scored.metrics)
        exp = phases.make_experience(run, samples, scored.scores)
        if estimator_needs(cfg, "needs_reward_components"):
            phases.reward_components(run, exp, scored.extras)
        if estimator_needs(cfg, "needs_greedy_baseline"):
            with timer("greedy_baseline"):
                m.update(phases.greedy_baselines(run, samples, exp))
        phases.release_engine(run, step)  # done with the engine until this step's sync
        if run.roles.reward is not None:
            with timer("reward_model"):
                phases.reward_model_scores(run, exp)
        if run.roles.ref is not None:
            with timer("ref"):
                phases.ref_log_probs(run, exp)
        with timer("old_log_prob"):
            m.update(phases.old_log_probs(run, exp))
        if run.teachers is not None:
            with timer("teacher"):
                m.update(distill.teacher_log_probs(run, exp))
        if run.roles.critic is not None:
            with timer("values"):
                phases.values(run, exp)
        with timer("adv"):
            m.update(phases.token_rewards(run, exp))
            m.update(phases.rollout_correction(run, exp))
            phases.advantages(run, exp)
            if run.teachers is not None:
                m.update(distill.distill_advantages(run, exp))
        idle = trains_on_nothing(exp.mask, run.ps)  # then no optimizer steps: zero gradients would still move weights
        if idle:
            m["train/nothing_to_train"] = 1.0
        if run.roles.critic is not None and not idle:
            with timer("update_critic"):
                m.update(phases.update_critic(run, exp, step))
        if step > cfg.trainer.critic_warmup:
            if not idle:
                with timer("update_actor"):
                    m.update(phases.update_actor(run, exp, step))
            with timer("weight_sync"):
                stopping = stop is not None and stop.reason() is not None
                m.update(source.around_sync(step, phases.skip_sync if stopping else phases.sync_weights))
    m.update(reward_metrics)
    m.update(phases.step_metrics(run, exp))
    m.update(timer.metrics())
    tokens = sum(len(p) + len(r) for p, r in zip(samples.prompt_ids, samples.response_ids))
    m["perf/tokens_per_s"] = tokens / max(timer.seconds["step"], 1e-9)
    m.setdefault("kl/coef", run.kl_ctrl.value)
    m.update(run.guard.metrics())
    return m
