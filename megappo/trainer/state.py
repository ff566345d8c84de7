"""The run and its state.

`Run` is what every phase reads: the config, the process groups, the models and the services around them (rollout,
reward scorer), the losses. `TrainState` owns everything a checkpoint holds besides the models, optimizers and
random streams: the step, the data position, the KL controller, the guard's scales and the version of the weights
the rollout engines hold. A checkpoint is `TrainState.state_dict()` plus the roles' weights (checkpointing.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Optional, Union

from megappo.algos import AdaptiveKLController, FixedKLController
from megappo.algos.rollout_correction import RolloutCorrection
from megappo.config.schema import MegappoConfig
from megappo.models.compute import LossFn
from megappo.parallel import ParallelState
from megappo.platform.device import Platform
from megappo.rewards.scorer import RewardScorer
from megappo.rollout.sampling import SamplingParams
from megappo.trainer import settings
from megappo.trainer.experience import Samples
from megappo.trainer.guard import KLGuard
from megappo.trainer.metrics import MetricsLogger
from megappo.trainer.replay import Replay
from megappo.trainer.roles import Roles
from megappo.trainer.rollout import RolloutWorker
from megappo.trainer.run_lock import RunLock

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from megappo.trainer.teachers import Teachers

    from megappo.data.dataset import PromptBatch
    from megappo.data.loader import PromptLoader
    from megappo.multi_turn.health import ToolWatch

KLController = Union[FixedKLController, AdaptiveKLController]


@dataclass
class TrainState:
    """Where the run is (checkpointed), and where it writes (not)."""

    step: int  # steps finished (0: none)
    total_steps: int
    loader: "PromptLoader"  # the training prompts; its position is checkpointed
    val_loader: Optional["PromptLoader"]
    kl_ctrl: KLController  # the in-reward KL coefficient (moves when adaptive)
    guard: KLGuard  # its scales and rollback counts are checkpointed
    weight_version: int = 0  # the version of the actor's weights the rollout engines hold (+1 per sync)
    # version -> the number of updates (steps) of the weights it names: how far behind the trainer a batch's policy
    # and the critic that values it are, in updates (the recent versions only)
    version_steps: dict[int, int] = field(default_factory=lambda: {0: 0})
    # async_training: the batches generated for the next steps, oldest first, and the data position before the
    # batches still being generated (a resumed run generates them again)
    ready: list[Samples] = field(default_factory=list)
    pending_position: Optional[dict] = None
    # samples of the batches still being generated at the save (episodes paused mid-way included): a run resumed
    # from it generates them again from their rows (`async/restarted_samples` at its first step)
    unfinished_samples: int = 0
    # not checkpointed: where the run writes
    local_dir: str = ""
    logger: Optional[MetricsLogger] = None
    resumed: bool = False  # started from a checkpoint (of this or an earlier process)
    lock: Optional[RunLock] = field(default=None, repr=False)  # rank 0's hold on local_dir, released by teardown

    def synced(self, version: int, updates: int) -> None:
        """The engines now hold `version`: the actor after `updates` updates."""
        self.weight_version = version
        self.version_steps[version] = updates
        for old in sorted(self.version_steps)[:-64]:  # staleness is bounded: older versions are never asked for
            del self.version_steps[old]

    def batches(self) -> Iterator["PromptBatch"]:
        """The training batches from the saved position on, epoch after epoch."""
        while True:
            yield from self.loader

    def state_dict(self) -> dict:
        out = {"dataloader": self.pending_position or self.loader.state_dict(), "kl_ctrl": self.kl_ctrl.state_dict(),
               "guard": self.guard.state_dict(), "weight_version": self.weight_version,
               "version_steps": {str(v): s for v, s in self.version_steps.items()}}
        if self.ready or self.unfinished_samples:
            out["rollout_queue"] = {"ready": [samples.to_json() for samples in self.ready],
                                    "unfinished_samples": self.unfinished_samples}
        return out

    def load_state_dict(self, saved: dict, *, keep_guard: bool = False) -> None:
        """Take a checkpoint's state; `keep_guard` (a rollback) keeps the guard's newer scales, which are the point
        of rolling back."""
        self.step = int(saved["step"])
        self.loader.load_state_dict(saved["dataloader"])
        self.kl_ctrl.load_state_dict(saved["kl_ctrl"])
        if not keep_guard:
            self.guard.load_state_dict(saved.get("guard") or {})
        self.weight_version = int(saved.get("weight_version", 0))
        steps = saved.get("version_steps") or {self.weight_version: self.step}
        self.version_steps = {int(v): int(s) for v, s in steps.items()}
        queue = saved.get("rollout_queue") or {}
        self.ready = [Samples(**r) for r in queue.get("ready", [])]
        self.unfinished_samples = int(queue.get("unfinished_samples", 0))
        self.pending_position = None


@dataclass
class Run:
    """What every phase reads: the config, the process groups, the models and the services around them."""

    cfg: MegappoConfig
    ps: ParallelState
    platform: Platform
    roles: Roles
    rollout: RolloutWorker
    scorer: Optional[RewardScorer]  # rule rewards, on global rank 0 only
    tokenizer: "PreTrainedTokenizerBase"
    pad_token_id: int
    batching: settings.Batching
    sampling: SamplingParams
    actor_loss: LossFn  # rebuilt with the guard's scaled clip ratio and KL coefficient (`apply_guard_scales`)
    critic_loss: LossFn
    state: TrainState
    correction: RolloutCorrection  # algorithm.rollout_correction, checked
    reward_failing_steps: int = 0  # steps in a row whose reward function failed on too many samples
    tool_watch: Optional["ToolWatch"] = None  # multi-turn tool warnings and failing streak, made at the first step
    failure_watch: Optional[Any] = None  # failed episodes' warnings and streak (`megappo.envs.failures.FailureWatch`)
    teachers: Optional["Teachers"] = None  # distillation's teachers (`megappo.trainer.teachers`), when enabled
    judge: Optional[Any] = None  # reward_model.judge's deployment (every rank; rank 0's engine judges)
    # MoE router replay (actor.megatron.router_replay, chosen at setup; disabled until then)
    replay: Replay = field(default_factory=lambda: Replay("disabled", None))

    @property
    def kl_ctrl(self) -> KLController:
        return self.state.kl_ctrl

    @property
    def guard(self) -> KLGuard:
        return self.state.guard
