"""The configuration tree's `trainer` and `async_training` sections (importable from `megappo.config.schema`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional


@dataclass
class GuardConfig:
    """The tuning guide's rules for a run whose policy moves too far in one step, automated (megappo/trainer/guard.py).

    A step whose `kl_metric` passes `kl_threshold`, or whose actor loss or gradient norm is NaN/Inf, is undone: the
    last good checkpoint is restored (so rollback needs trainer.save_freq > 0; the guard then also saves step 0), the
    actor's learning rate is multiplied by lr_factor, the KL coefficient by kl_coef_factor and the clip ratio by
    clip_ratio_factor, and the step is tried again. After max_retries rollbacks without getting past the step, the
    run stops with its last good checkpoint. Without checkpoints a tripped step stops the run."""

    enable: bool = True
    kl_threshold: float = 0.2  # a step whose kl_metric passes this is rolled back
    kl_metric: str = "actor/ppo_kl"  # the step's metric compared with kl_threshold (e.g. kl/mean: KL to the reference)
    epoch_kl_stop: Optional[float] = None  # skip a step's remaining PPO epochs once an epoch's actor/ppo_kl passes it
    max_retries: int = 3  # rollbacks in a row (without passing the tripped step) before the run stops
    lr_factor: float = 0.5  # actor learning rate multiplier per rollback
    kl_coef_factor: float = 5.0  # kl_coef (in reward) / kl_loss_coef (as loss) multiplier per rollback: 0.001 -> 0.005
    clip_ratio_factor: float = 0.5  # clip_ratio (low and high) multiplier per rollback: 0.2 -> 0.1


@dataclass
class TrainerConfig:
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when available, else cpu
    nnodes: int = 1
    n_gpus_per_node: int = 8  # processes per node (CPU: ranks per node)
    total_epochs: int = 30  # passes over the training prompts
    total_training_steps: Optional[int] = None  # None: total_epochs * steps per epoch; set: caps the run
    critic_warmup: int = 0  # steps that update only the critic
    val_before_train: bool = True  # run validation once before the first step
    test_freq: int = -1  # validate every N steps (and after the last); -1: no periodic validation
    log_val_generations: int = 0  # validation samples printed/logged per validation
    save_freq: int = -1  # checkpoint every N steps (and after the last); -1: never
    max_ckpt_to_keep: Optional[int] = None  # oldest checkpoints deleted beyond this; None: keep all
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"  # auto: newest checkpoint in default_local_dir
    resume_from_path: Optional[str] = None  # checkpoint to load when resume_mode is resume_path
    default_local_dir: Optional[str] = None  # resolved: checkpoints/{project_name}/{experiment_name}
    # A run owns default_local_dir (a lock on <dir>/.megappo.lock): a second run on it exits 1 naming the holder, or
    # first waits up to this many seconds for it to go. 0 (interactive): fail at once; launch/slurm/*.sbatch set 300,
    # so a requeued job waits out its previous incarnation's last seconds.
    dir_lock_wait_s: float = 0.0
    project_name: str = "megappo_examples"
    experiment_name: str = "gsm8k"
    # metrics.jsonl in default_local_dir is always written; these are the other sinks
    logger: list[Literal["console", "tensorboard", "wandb"]] = field(default_factory=lambda: ["console", "tensorboard"])
    balance_batch: bool = True  # data-parallel ranks get similar token counts in each mini-batch
    guard: GuardConfig = field(default_factory=GuardConfig)
    # Save and stop (exit status 75, "requeue me") before this wall-clock time: ISO 8601 ("2026-12-04T06:00",
    # local time unless it has an offset), seconds since the epoch, or "slurm" for the job's end time
    # (SLURM_JOB_END_TIME). SIGTERM/SIGUSR1 do the same at once.
    save_before_deadline: Optional[str] = None


@dataclass
class AsyncTrainingConfig:
    """Rollouts that overlap training (megappo/trainer/rollout_source.py; verl's `async_training` names).

    sync: each step generates its batch, then trains. one_step_off: the batch of step k+1 is generated, with the
    weights step k started from, while step k trains; its samples are one update behind the policy that trains on
    them (off-policy by one step: see algorithm.rollout_correction). fully_async: a producer keeps generating the
    next steps' batches within a staleness budget (megappo/trainer/async_rollout.py), and the weights are synced
    every trigger_parameter_sync_step steps. Overlap needs the engine beside the trainer:
    actor_rollout_ref.hybrid_engine=false (the in-process engine then runs in its own process with
    rollout.engine_kwargs.threads CPU threads; SGLang servers are always separate processes)."""

    mode: Literal["sync", "one_step_off", "fully_async"] = "sync"
    # fully_async: a step trains require_batches mini-batches (data.train_batch_size must be require_batches *
    # actor.ppo_mini_batch_size prompts)
    require_batches: int = 1
    trigger_parameter_sync_step: int = 1  # fully_async: steps (local updates) between weight syncs, W
    # fully_async: the fraction of a sync window's samples (W steps' worth) that may be generated ahead with the
    # window before's weights: 0 none (no sample older than its window), 1 with W = 1 is one_step_off. A trained
    # batch is then at most floor((W - 1 + floor(staleness_threshold * W)) / W) weight versions old; staler ones
    # (generated under a looser threshold before a resume) are dropped and generated again.
    staleness_threshold: float = 0.1
    # fully_async: a weight sync aborts the generation in progress and continues its samples from their tokens
    # with the new weights (instead of waiting for it); needs an engine that can abort (hf)
    partial_rollout: bool = False
