"""The run's models: actor, reference, critic and reward model, built from Hugging Face checkpoints.

Every role lives on every rank in the actor's parallel layout (the megatron layer holds one layout per process),
starts from its HF checkpoint through the conversion code, and the trainable ones are wrapped in megatron's DDP with
megatron's optimizer and LR schedule. On GPU the frozen reference is offloaded to host memory between uses.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from torch import nn

from megappo.config.schema import MegappoConfig, ModelConfig
from megappo.convert.peft_io import load_peft_adapter
from megappo.kinds.build import build_model
from megappo.kinds.weights import load_hf_weights
from megappo.models.builder import model_config_summary, offload_to_cpu, reload
from megappo.models.hf_config import load_hf_config_dict
from megappo.models.lora.adapter import AdaptersOff, FullParameters, for_role
from megappo.models.optim import build_optimizer, build_scheduler, release_grad_buffers, wrap_ddp
from megappo.parallel import ParallelState
from megappo.platform.device import Platform
from megappo.trainer import settings


@dataclass
class Role:
    name: str  # actor | ref | critic | reward
    chunks: list[nn.Module]  # this rank's model chunks (DDP-wrapped when trainable)
    hf_dir: str  # the checkpoint it started from
    optimizer: Any = None
    scheduler: Any = None
    offloaded: bool = field(default=False, repr=False)
    # what its adapters mean to checkpoints, the reference and the weight sync (`megappo.models.lora.adapter`)
    adapter: FullParameters = field(default_factory=FullParameters)
    # the learning rates as built, before anything loads or scales them: each param group's (max_lr, min_lr), and
    # the schedule's (max_lr, min_lr, init_lr)
    base_lrs: list[tuple[float, float]] = field(default_factory=list, repr=False)
    base_schedule: tuple[float, float, float] = field(default=(0.0, 0.0, 0.0), repr=False)

    def remember_lrs(self) -> None:
        opt, sched = self.optimizer, self.scheduler
        self.base_lrs = [(g.get("max_lr", sched.max_lr), g.get("min_lr", sched.min_lr)) for g in opt.param_groups]
        self.base_schedule = (sched.max_lr, sched.min_lr, sched.init_lr)

    def scale_lr(self, scale: float) -> None:
        """Set the learning rates to `scale` times those as built (after a load: loading an optimizer state
        replaces the param group dicts, so they are set by position)."""
        sched = self.scheduler
        for group, (max_lr, min_lr) in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["max_lr"], group["min_lr"] = max_lr * scale, min_lr * scale
        max_lr, min_lr, init_lr = self.base_schedule
        sched.max_lr, sched.min_lr, sched.init_lr = max_lr * scale, min_lr * scale, init_lr * scale
        sched.step(0)  # recompute the param groups' current lr


@dataclass
class Roles:
    actor: Role
    ref: Optional[Role]  # when use_kl_loss or use_kl_in_reward
    critic: Optional[Role]  # when the advantage estimator needs values (gae)
    reward: Optional[Role]  # when reward_model.enable
    hf_config: dict  # the actor's HF config (weight sync and export name tensors by it)


def optimizer_steps(cfg: MegappoConfig, total_training_steps: int, role: str) -> int:
    """Optimizer steps a role takes over the run (the LR schedule's length)."""
    b = settings.batching(cfg)
    if role == "actor":
        steps = max(total_training_steps - cfg.trainer.critic_warmup, 1)
        return steps * b.actor_mini_batches * b.actor_epochs
    return total_training_steps * b.critic_mini_batches * b.critic_epochs


def _architecture(model_cfg, path: str) -> tuple[dict, dict]:
    """(the HF config with model.override_config applied, megatron TransformerConfig overrides)."""
    hf = {**load_hf_config_dict(path), **model_cfg.override_config}
    tc = {}
    if model_cfg.enable_gradient_checkpointing:
        tc = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    return hf, tc


def _build(name: str, path: str, model_cfg, ps: ParallelState, platform: Platform, seed: int,
           adapter: FullParameters, base: Optional[list[nn.Module]] = None,
           freeze_vision_tower: bool = True) -> list[nn.Module]:
    """`base`: the actor's chunks whose frozen base the critic's model shares instead of loading its own."""
    hf, tc = _architecture(model_cfg, path)
    tc.update(adapter.build_overrides())
    # vision-language models: actor.freeze_vision_tower (the reference's tower is always frozen; text models ignore it)
    chunks = build_model(hf, name, ps, platform, seed=seed, config_overrides=tc,
                         freeze_vision_tower=freeze_vision_tower)
    if base is not None:
        from megappo.models.lora import share_base

        # the critic's freshly built base is released for the actor's tensors: only the value head stays its own
        share_base(chunks, base)
    else:
        load_hf_weights(chunks, path, ps)
    adapter.convert(chunks, ps, hf)
    return chunks


def _trainable(name: str, path: str, model_cfg, cfg: MegappoConfig, ps: ParallelState, platform: Platform,
               total_steps: int, seed: int, actor: Optional[Role] = None) -> Role:
    """`actor`: the actor's role, whose base a critic may share (`critic.model.lora.share_actor_base`)."""
    lora = model_cfg.lora
    adapter = for_role(name, settings.lora_settings(lora, seed), path, adapter_path=lora.adapter_path,
                       share_actor_base=lora.share_actor_base, load_adapter=load_peft_adapter)
    base = adapter.shared_base(actor.chunks) if actor is not None else None
    # the critic's vision tower trains or stays fixed as the actor's does (one switch for the run's towers)
    chunks = _build(name, path, model_cfg, ps, platform, seed, adapter, base,
                    cfg.actor_rollout_ref.actor.freeze_vision_tower)
    opt = settings.optim_settings(cfg, name, optimizer_steps(cfg, total_steps, name))
    ddp = wrap_ddp(chunks, opt, platform, pg_collection=ps.pg_collection)
    optimizer = build_optimizer(ddp, opt, platform)
    release_grad_buffers(ddp)  # allocated by each update (phases.update_actor/critic), free between them
    role = Role(name, ddp, path, optimizer, build_scheduler(optimizer, opt), adapter=adapter)
    role.remember_lrs()
    return role


def _frozen(name: str, path: str, model_cfg, ps: ParallelState, platform: Platform, seed: int) -> Role:
    role = Role(name, _build(name, path, model_cfg, ps, platform, seed, FullParameters()), path)
    if platform.is_cuda:
        offload_to_cpu(role.chunks)
        role.offloaded = True
    return role


def frozen_role(name: str, path: str, ps: ParallelState, platform: Platform, seed: int) -> Role:
    """A frozen model of its own HF checkpoint in the run's layout (a distillation teacher), offloaded on GPU."""
    return _frozen(name, path, ModelConfig(), ps, platform, seed)


def build_roles(cfg: MegappoConfig, ps: ParallelState, platform: Platform, total_steps: int) -> Roles:
    arr, seed = cfg.actor_rollout_ref, cfg.actor_rollout_ref.actor.megatron.seed
    path = arr.model.path
    actor = _trainable("actor", path, arr.model, cfg, ps, platform, total_steps, seed)
    ref = None
    if arr.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
        own = actor.adapter.reference_chunks(actor.chunks)  # a LoRA actor's base: the actor with adapters off
        ref = Role("ref", own, path, adapter=AdaptersOff()) if own is not None else \
            _frozen("ref", path, arr.model, ps, platform, seed)
    critic = None
    if cfg.critic.enable:
        critic = _trainable("critic", cfg.critic.model.path, cfg.critic.model, cfg, ps, platform, total_steps,
                            seed + 1, actor)
    reward = None
    if cfg.reward_model.enable:
        reward = _frozen("reward", cfg.reward_model.path, ModelConfig(), ps, platform, seed)
    return Roles(actor, ref, critic, reward, _architecture(arr.model, path)[0])


class on_device:  # noqa: N801 - used as a context manager, like torch.no_grad
    """Bring an offloaded frozen role's weights to the device for one phase, and send them back after."""

    def __init__(self, role: Role, platform: Platform):
        self.role, self.platform = role, platform
        self.active = None

    def __enter__(self) -> Role:
        if self.role.offloaded:
            reload(self.role.chunks, self.platform.device)
        self.active = self.role.adapter.active(self.role.chunks)
        self.active.__enter__()
        return self.role

    def __exit__(self, *exc: Any) -> None:
        self.active.__exit__(*exc)
        self.active = None
        if self.role.offloaded:
            offload_to_cpu(self.role.chunks)


def describe(roles: Roles, ps: ParallelState) -> list[str]:
    out = []
    for role in (roles.actor, roles.ref, roles.critic, roles.reward):
        if role is not None:
            out += role.adapter.describe(role.name, role.chunks, lambda role=role: _summary(role, roles, ps))
    return out


def _summary(role: Role, roles: Roles, ps: ParallelState) -> list[str]:
    lines = [model_config_summary(role.chunks, ps)]
    if role.name == "critic" and _shares_base(role, roles.actor):
        lines.append("critic: its adapters and value head over the actor's base (one copy of the base)")
    return lines


def _shares_base(critic: Role, actor: Role) -> bool:
    from megappo.models.builder import unwrap

    mine = {p.data_ptr() for c in actor.chunks for p in unwrap(c).parameters() if not p.requires_grad}
    return any(p.data_ptr() in mine for c in critic.chunks for p in unwrap(c).parameters())
