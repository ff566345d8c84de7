"""Everything `fit` needs before its first step: process groups, the synthetic task if asked for, data, models,
rollout engine, reward scorer, KL controller, logger, and the state of a resumed run."""
from __future__ import annotations

import copy
import os
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

from megappo.config import resolve
from megappo.config.schema import MegappoConfig
from megappo.models.losses import actor_loss_fn, critic_loss_fn
from megappo.parallel import destroy_parallel, init_parallel
from megappo.platform.device import detect_platform
from megappo.platform.layout import ParallelLayout
from megappo.trainer import checkpointing, judge, run_config, settings
from megappo.trainer.guard import KLGuard
from megappo.trainer.inputs import load_data, load_tokenizer
from megappo.trainer.metrics import MetricsLogger
from megappo.trainer.preflight import preflight, require_output_dir
from megappo.trainer.replay import Replay
from megappo.trainer.roles import build_roles, describe
from megappo.trainer.rollout import RolloutWorker
from megappo.trainer.run_lock import AlreadyFinished, DirLocked, RunLock, finished_message
from megappo.trainer.state import Run, TrainState
from megappo.trainer.teachers import build_teachers


def _threads_per_rank() -> None:
    """CPU threads per rank: MEGAPPO_CPU_THREADS, else OMP_NUM_THREADS, else 1. On a 2-core machine one thread per
    rank measured 3-4x faster than two (and the tiny recipe 4x faster under load); raise it for larger CPU runs."""
    for var in ("MEGAPPO_CPU_THREADS", "OMP_NUM_THREADS"):
        if os.environ.get(var, "").isdigit() and int(os.environ[var]) > 0:
            torch.set_num_threads(int(os.environ[var]))
            return
    torch.set_num_threads(1)


def _synthetic(cfg: MegappoConfig, local_dir: str) -> None:
    """Write the built-in task's model and prompts (rank 0; the others wait) and point the config at them."""
    syn = cfg.data.synthetic
    if not syn.name:
        return
    from megappo.tasks import prepare_task

    out = os.path.join(local_dir, "synthetic", syn.name)
    files = [None]
    if dist.get_rank() == 0:
        files = [prepare_task(syn.name, out, num_train_prompts=syn.num_train_prompts,
                              num_val_prompts=syn.num_val_prompts, warm_start_steps=syn.warm_start_steps,
                              seed=syn.seed)]
    dist.broadcast_object_list(files, src=0)
    task = files[0]
    arr = cfg.actor_rollout_ref
    for model in (arr.model, cfg.critic.model):
        model.path, model.tokenizer_path = task.model_dir, task.model_dir
    cfg.data.train_files, cfg.data.val_files = task.train_files, task.val_files
    if syn.teacher_smoothing is not None:
        teacher = [None]
        if dist.get_rank() == 0:
            from megappo.tasks.teacher import prepare_teacher

            teacher = [prepare_teacher(syn.name, os.path.join(local_dir, "synthetic", syn.name + "-teacher"),
                                       smoothing=syn.teacher_smoothing, warm_start_steps=syn.teacher_warm_start_steps,
                                       num_val_prompts=syn.num_val_prompts, seed=syn.seed)]
        dist.broadcast_object_list(teacher, src=0)
        if cfg.distillation.teacher_model.model_path is None:
            cfg.distillation.teacher_model.model_path = teacher[0]


def _scorer(cfg: MegappoConfig):
    if dist.get_rank() != 0:
        return None
    from megappo.rewards.registry import load_custom_reward_fn
    from megappo.rewards.scorer import RewardScorer

    rm, crf = cfg.reward_model, cfg.custom_reward_function
    fn = load_custom_reward_fn(crf.path, crf.name) if crf.path else None
    return RewardScorer(fn, num_workers=rm.num_workers, backend=rm.backend, timeout_s=rm.timeout_s,
                        failure_score=rm.failure_score, ray_address=rm.ray_address)


def setup(cfg: MegappoConfig) -> tuple[Run, TrainState]:
    cfg = resolve(copy.deepcopy(cfg))
    t = cfg.trainer
    platform = detect_platform(t.device, cfg.actor_rollout_ref.model.dtype)
    if not platform.is_cuda:
        _threads_per_rank()
    ps = init_parallel(ParallelLayout.from_megatron_config(cfg.actor_rollout_ref.actor.megatron), platform,
                       seed=cfg.actor_rollout_ref.actor.megatron.seed)
    local_dir = os.path.abspath(os.path.expanduser(t.default_local_dir))
    require_output_dir(cfg)  # a clear error before the lock creates local_dir (`megappo train` checked it too)
    lock = _own_dir(local_dir, t.dir_lock_wait_s)  # before anything in local_dir is read, written or removed
    run = state = None
    config_text = run_config.snapshot(cfg)  # before the run fills in paths of its own (a synthetic task's)
    try:
        if t.total_training_steps:  # the end is known before the synthetic task is (re)built: nothing is written
            _stop_if_finished(cfg, local_dir, t.total_training_steps, config_text)
        # every rank loads the judge's parser: a broken one stops them all, before any warm start or deployment
        parse = judge.load_parser(cfg) if cfg.reward_model.judge.enable else None
        _synthetic(cfg, local_dir)
        judge.prepare_builtin(cfg, local_dir)
        preflight(cfg, world_size=ps.world_size, check_files=True)  # `megappo train` did too; fit may be called alone
        tokenizer = load_tokenizer(cfg)
        loader, val_loader = load_data(cfg, tokenizer)
        total = t.total_training_steps or t.total_epochs * len(loader)
        if not t.total_training_steps:
            _stop_if_finished(cfg, local_dir, total, config_text)
        roles = build_roles(cfg, ps, platform, total)
        state = TrainState(0, total, loader, val_loader, local_dir=local_dir, lock=lock,
                           kl_ctrl=settings.kl_controller(cfg), guard=KLGuard(t.guard, can_roll_back=t.save_freq > 0))
        run = Run(cfg=cfg, ps=ps, platform=platform, roles=roles,
                  rollout=RolloutWorker(cfg, ps, platform, roles.actor.adapter),
                  scorer=None if cfg.reward_model.enable else _scorer(cfg), tokenizer=tokenizer,
                  pad_token_id=loader.dataset.pad_token_id, batching=settings.batching(cfg),
                  sampling=settings.sampling(cfg), actor_loss=actor_loss_fn(settings.actor_loss(cfg)),
                  critic_loss=critic_loss_fn(settings.critic_loss(cfg)), state=state,
                  correction=settings.rollout_correction(cfg))
        run.replay = Replay.of(cfg, roles)
        run.teachers = build_teachers(cfg, ps, platform, settings.rollout_settings(cfg))
        run.judge = judge.deploy_judge(cfg, ps, platform)  # collective
        if run.judge is not None and dist.get_rank() == 0:
            run.scorer = judge.judge_scorer(cfg, run.judge, run.scorer, parse)
        apply_guard_scales(run)
        _resume(run, state)
        if dist.get_rank() == 0:
            run_config.record(local_dir, config_text, resumed=state.resumed)
            teachers = run.teachers.describe(ps) if run.teachers is not None else []
            print("megappo train: " + "\n  ".join([f"{total} steps, output in {local_dir}", *describe(roles, ps),
                                                   *teachers]),
                  file=sys.stderr, flush=True)
        state.logger = MetricsLogger(local_dir, t.logger, total, enabled=dist.get_rank() == 0,
                                     start_step=state.step, resumed=state.resumed,
                                     run_name=(t.project_name, t.experiment_name), hidden=_console_hidden(cfg))
    except BaseException:
        if run is not None:
            teardown_run(run, state)  # the engine (an SGLang server) and reward workers are already running
        if lock is not None:
            lock.release()  # fit's teardown gets no state from a failed setup; an in-process caller may go on
        raise
    return run, state


def _console_hidden(cfg: MegappoConfig) -> tuple[str, ...]:
    """Keys kept off the console line: the tool loop's episodes log env/reward_mean 0 (no environment rewards them,
    the reward function does), which would read as a failing environment."""
    agent = cfg.actor_rollout_ref.rollout.agent
    tools_only = not agent.agent_loop_config_path and agent.default_agent_loop in (None, "tool_agent")
    return ("env/reward_mean",) if tools_only else ()


def _own_dir(local_dir: str, wait_s: float) -> Optional[RunLock]:
    """Rank 0 locks `local_dir` (waiting up to `wait_s` for another run to let go), every rank learns the outcome
    after each try: a second run's ranks all leave, rank 0 with DirLocked (exit status 1, naming the holder), the
    others quietly with status 1. Collective; returns rank 0's lock (None elsewhere)."""
    rank0 = dist.get_rank() == 0
    lock = RunLock(local_dir) if rank0 else None
    start = time.monotonic()
    verdict = ["wait"]
    # one broadcast per try (about a second): the other ranks never sit in one collective for the whole wait,
    # which may be longer than the process groups' timeout
    while verdict[0] == "wait":
        if rank0:
            verdict[0] = lock.poll(start + max(0.0, wait_s))
        dist.broadcast_object_list(verdict, src=0)
    if verdict[0] == "ok":
        return lock
    if rank0:
        message = lock.locked_message(time.monotonic() - start)
        lock.close()
        raise DirLocked(message)
    raise SystemExit(1)


def _stop_if_finished(cfg: MegappoConfig, local_dir: str, total: int, config_text: str) -> None:
    """A run started again over a finished one (trainer.resume_mode=auto, the same number of steps) says so and
    raises AlreadyFinished on every rank (`fit` returns 0), before it builds a model or writes a file: no summary,
    no step, no second export or empty TensorBoard file. Collective."""
    if cfg.trainer.resume_mode != "auto":  # disable trains again; resume_path continues where it is told
        return
    message = [finished_message(local_dir, total) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(message, src=0)
    if message[0] is not None:
        if dist.get_rank() == 0:
            print(message[0], file=sys.stderr, flush=True)
            run_config.warn_finished(local_dir, config_text)
        raise AlreadyFinished(message[0])


def _resume(run: Run, state: TrainState) -> None:
    """Continue from the checkpoint `trainer.resume_mode` picks, if any, after removing unfinished saves."""
    t = run.cfg.trainer
    if dist.get_rank() == 0:
        checkpointing.remove_stale(state.local_dir)
    dist.barrier()
    resume = checkpointing.find_resume_dir(state.local_dir, t.resume_mode, t.resume_from_path)
    if resume is not None:
        restore(run, state, resume)
        state.resumed = True
        if dist.get_rank() == 0:
            print(f"megappo train: resumed from {resume} (step {state.step}); continuing at step {state.step + 1} "
                  f"of {state.total_steps}", file=sys.stderr, flush=True)


def restore(run: Run, state: TrainState, directory: str, *, rollback: bool = False) -> None:
    """Return the run to a checkpoint: weights, optimizers, schedulers, RNG, data position, KL controller and the
    rollout engine's weights. A resume also takes the guard's state from it; a rollback keeps the guard's newer
    scales (that is the point of rolling back)."""
    saved = checkpointing.load(run, directory)
    state.load_state_dict(saved, keep_guard=rollback)
    apply_guard_scales(run, scale_of_restored_kl=float((saved.get("guard") or {}).get("kl_scale", 1.0)))
    # the engines get the restored weights under their own version number (not a new one), so a resumed run's
    # rollout/weight_version is the uninterrupted run's
    run.rollout.sync_weights(run.roles.actor.chunks, run.roles.hf_config, state.weight_version)


def apply_guard_scales(run: Run, scale_of_restored_kl: float = 1.0) -> None:
    """Put the KL guard's scales into effect after setup, a resume or a rollback, each by its owner: the actor's
    learning rates and the loss are set from their built values; the KL controller, whose value moves (adaptive),
    is rescaled from the value just restored, which was saved under `scale_of_restored_kl`."""
    scales = run.guard.scales()
    run.roles.actor.scale_lr(scales.lr)
    run.state.kl_ctrl.rescale(scales.kl / scale_of_restored_kl)
    run.actor_loss = actor_loss_fn(settings.actor_loss(run.cfg, clip_scale=scales.clip, kl_scale=scales.kl))


def rollback(run: Run, state: TrainState, step: int, reason: str) -> None:
    """Undo a step the guard refused: back to the last good checkpoint, with the guard's scales one notch further
    (or RunStopped when the retries are used up). Collective."""
    last = checkpointing.latest_step(state.local_dir)
    last_dir = checkpointing.step_dir(state.local_dir, last) if last is not None else None
    run.guard.plan_rollback(step, reason, last_dir)
    s = run.guard.state
    if dist.get_rank() == 0:
        print(f"megappo train: the KL guard rolled step {step} back to {last_dir} ({reason}); retry "
              f"{s.retries}/{run.guard.cfg.max_retries} with lr x{s.lr_scale:.3g}, kl_coef x{s.kl_scale:.3g}, "
              f"clip_ratio x{s.clip_scale:.3g}", file=sys.stderr, flush=True)
    restore(run, state, last_dir, rollback=True)


def teardown(run: Optional[Run], state: Optional[TrainState]) -> None:
    """Stop every process and file the run started, then let go of its directory; safe to call after a failed
    setup."""
    teardown_run(run, state)
    if state is not None and state.lock is not None:
        state.lock.release()  # last: the run's files are closed and its helpers stopped
    destroy_parallel(destroy_process_group=True)


def teardown_run(run: Optional[Run], state: Optional[TrainState]) -> None:
    """The logger, rollout engine, judge engine and reward workers (not the process groups or the directory's
    lock)."""
    if state is not None and state.logger is not None:
        state.logger.close()
    if run is not None:
        run.rollout.close()
        if run.teachers is not None:
            run.teachers.close()  # an engine teacher's servers or process
        if run.judge is not None:
            run.judge.close()
        if run.scorer is not None:
            run.scorer.close()
