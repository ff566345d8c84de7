"""The one place the config tree's names become the plain settings the lower layers take.

verl's config names and megappo.algos' keyword names differ (`clip_ratio_c` -> `clip_c`, `cliprange_value` ->
`clip_range`, `loss_agg_mode` -> `agg_mode`, ...); the mapping is written here and nowhere else, so the compute
layer and the math never see a config object.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any, Optional

from megappo import algos
from megappo.algos.estimators import EstimatorParams
from megappo.algos.policy_losses import loss_params
from megappo.algos.rollout_correction import RolloutCorrection
from megappo.config.schema import MegappoConfig
from megappo.models.compute import MicroBatching
from megappo.models.losses import ActorLossSettings, CriticLossSettings, DistillLossSettings
from megappo.rollout import registry
from megappo.models.lora.adapter import served_adapter
from megappo.models.lora.layers import LoRASettings
from megappo.models.optim import OptimSettings
from megappo.envs.loop import EpisodeSettings
from megappo.platform.rules import by_name
from megappo.rollout.sampling import SamplingParams
from megappo.rollout.settings import AdapterServing, RolloutSettings


def actor_loss(cfg: MegappoConfig, clip_scale: float = 1.0, kl_scale: float = 1.0) -> ActorLossSettings:
    """The actor loss's settings, with the KL guard's scales of the clip ratio and the KL loss coefficient."""
    a = cfg.actor_rollout_ref.actor
    correction = rollout_correction(cfg)
    bypass = correction if correction.bypass_mode else None
    pl = a.policy_loss
    # the loss's settings and the actor's loss terms named as their keys (entropy_coeff, use_kl_loss,
    # kl_loss_type, dro_beta, ...) are read by name; the ones named otherwise, or scaled, are mapped here
    return by_name(ActorLossSettings, a, clip_low=a.clip_ratio_low * clip_scale,
                   clip_high=a.clip_ratio_high * clip_scale, clip_c=a.clip_ratio_c, agg_mode=a.loss_agg_mode,
                   kl_loss_coef=a.kl_loss_coef * kl_scale, bypass=bypass, loss_mode=pl.loss_mode,
                   loss_params=loss_params(pl.loss_mode, pl, a), custom_loss=(pl.path, pl.name),
                   norm_length=norm_length(cfg), distill=distill_loss(cfg))


def distill_loss(cfg: MegappoConfig) -> Optional[DistillLossSettings]:
    """On-policy distillation's loss term, when distillation is enabled without use_policy_gradient."""
    d = cfg.distillation
    dl = d.distillation_loss
    if not d.enabled or dl.use_policy_gradient:
        return None
    return DistillLossSettings(mode=dl.loss_mode, coef=dl.distillation_loss_coef if dl.use_task_rewards else 1.0,
                               log_prob_min_clamp=dl.log_prob_min_clamp, loss_max_clamp=dl.loss_max_clamp)


def norm_length(cfg: MegappoConfig) -> float:
    """seq-mean-token-sum-norm's divisor: actor.loss_scale_factor, else the response length limit (verl's default
    is the batch's padded response length, which here would differ between micro-batches)."""
    factor = cfg.actor_rollout_ref.actor.loss_scale_factor
    return float(factor if factor is not None else cfg.data.max_response_length)


def kl_controller(cfg: MegappoConfig) -> algos.FixedKLController | algos.AdaptiveKLController:
    """The in-reward KL coefficient's controller, `algorithm.kl_ctrl`."""
    kl = cfg.algorithm.kl_ctrl
    return algos.build_kl_controller(kl.type, kl_coef=kl.kl_coef, target_kl=kl.target_kl, horizon=kl.horizon)


def estimator_params(cfg: MegappoConfig) -> EstimatorParams:
    alg = cfg.algorithm
    weights = tuple(alg.gdpo_reward_weights) if alg.gdpo_reward_weights else None
    return EstimatorParams(gamma=alg.gamma, lam=alg.lam, norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
                           gdpo_reward_weights=weights)


def rollout_correction(cfg: MegappoConfig) -> RolloutCorrection:
    """algorithm.rollout_correction as the math's settings (preflight runs their `check`)."""
    return RolloutCorrection(**asdict(cfg.algorithm.rollout_correction))


def critic_loss(cfg: MegappoConfig) -> CriticLossSettings:
    c = cfg.critic
    return CriticLossSettings(clip_range=c.cliprange_value, agg_mode=c.loss_agg_mode, norm_length=norm_length(cfg))


@dataclass(frozen=True)
class Batching:
    """How a step's samples are cut: mini-batches per epoch and the micro-batching of each compute."""

    actor_mini_batches: int  # optimizer steps per actor epoch
    critic_mini_batches: int
    actor_epochs: int
    critic_epochs: int
    actor_shuffle: bool
    critic_shuffle: bool
    shuffle_seed: int
    actor_train: MicroBatching
    critic_train: MicroBatching
    old_log_prob: MicroBatching
    ref_log_prob: MicroBatching
    values: MicroBatching
    reward_model: MicroBatching


def batching(cfg: MegappoConfig) -> Batching:
    arr, a, c = cfg.actor_rollout_ref, cfg.actor_rollout_ref.actor, cfg.critic
    train = cfg.data.train_batch_size
    lm = dict(packed=bool(arr.model.use_remove_padding), share_prefix=arr.model.use_prefix_sharing)
    critic = dict(packed=bool(c.model.use_remove_padding), share_prefix=c.model.use_prefix_sharing)
    return Batching(
        actor_mini_batches=train // a.ppo_mini_batch_size,
        critic_mini_batches=train // (c.ppo_mini_batch_size or a.ppo_mini_batch_size),
        actor_epochs=a.ppo_epochs, critic_epochs=c.ppo_epochs or a.ppo_epochs,
        actor_shuffle=a.shuffle, critic_shuffle=bool(c.shuffle),
        shuffle_seed=a.data_loader_seed if a.data_loader_seed is not None else cfg.data.seed,
        actor_train=MicroBatching(a.ppo_micro_batch_size_per_gpu, a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu,
                                  **lm),
        critic_train=MicroBatching(c.ppo_micro_batch_size_per_gpu, bool(c.use_dynamic_bsz),
                                   c.ppo_max_token_len_per_gpu, **critic),
        old_log_prob=MicroBatching(arr.rollout.log_prob_micro_batch_size_per_gpu,
                                   bool(arr.rollout.log_prob_use_dynamic_bsz),
                                   arr.rollout.log_prob_max_token_len_per_gpu, **lm),
        ref_log_prob=MicroBatching(arr.ref.log_prob_micro_batch_size_per_gpu, bool(arr.ref.log_prob_use_dynamic_bsz),
                                   arr.ref.log_prob_max_token_len_per_gpu, **lm),
        values=MicroBatching(c.ppo_micro_batch_size_per_gpu, bool(c.use_dynamic_bsz),
                             c.forward_max_token_len_per_gpu, **critic),
        reward_model=MicroBatching(cfg.reward_model.micro_batch_size_per_gpu,
                                   packed=bool(cfg.reward_model.use_remove_padding)),
    )


def optim_settings(cfg: MegappoConfig, role: str, total_steps: int) -> OptimSettings:
    """Optimizer and LR schedule of the actor or the critic; `total_steps` counts optimizer steps."""
    if role == "actor":
        optim, meg = cfg.actor_rollout_ref.actor.optim, cfg.actor_rollout_ref.actor.megatron
    else:
        optim, meg = cfg.critic.optim, cfg.critic.megatron
    return OptimSettings(lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay,
                         clip_grad=optim.clip_grad, total_steps=total_steps, lr_warmup_steps=optim.lr_warmup_steps,
                         lr_warmup_steps_ratio=optim.lr_warmup_steps_ratio, lr_scheduler=optim.lr_scheduler,
                         min_lr_ratio=optim.min_lr_ratio, use_distributed_optimizer=meg.use_distributed_optimizer)


def sampling(cfg: MegappoConfig, *, validate: bool = False, seed: Optional[int] = None) -> SamplingParams:
    """`actor_rollout_ref.rollout`'s sampling (its `val_kwargs` when validate; checked by the config's rules)."""
    rollout = cfg.actor_rollout_ref.rollout
    src = rollout.val_kwargs if validate else rollout
    return SamplingParams(max_new_tokens=rollout.response_length, temperature=src.temperature, top_p=src.top_p,
                          top_k=src.top_k, n=src.n, greedy=not src.do_sample, ignore_eos=rollout.ignore_eos, seed=seed,
                          return_routed_experts=rollout.enable_rollout_routing_replay and not validate)


def episodes(cfg: MegappoConfig) -> Optional[EpisodeSettings]:
    """`rollout.multi_turn` and `rollout.agent` with the tokenizer and the response budget the episodes run with;
    None when the samples are single-turn (no tool loop, no agent)."""
    arr = cfg.actor_rollout_ref
    mt, agent = arr.rollout.multi_turn, arr.rollout.agent
    if not (mt.enable or agent.default_agent_loop or agent.agent_loop_config_path):
        return None
    return EpisodeSettings(
        tokenizer_path=cfg.data.tokenizer or arr.model.tokenizer_path or arr.model.path,
        trust_remote_code=arr.model.trust_remote_code, response_length=cfg.data.max_response_length,
        max_assistant_turns=mt.max_assistant_turns, max_user_turns=mt.max_user_turns,
        tokenization_sanity_check_mode=mt.tokenization_sanity_check_mode,
        tool_config_path=mt.tool_config_path if mt.enable else None, format=mt.format,
        max_parallel_calls=mt.max_parallel_calls, max_tool_response_length=mt.max_tool_response_length,
        tool_response_truncate_side=mt.tool_response_truncate_side, tool_backend=mt.tool_backend,
        tool_workers=mt.tool_workers, tool_timeout_s=mt.tool_timeout_s,
        default_agent=agent.default_agent_loop, agent_config_path=agent.agent_loop_config_path,
        num_workers=agent.num_workers, step_timeout_s=agent.step_timeout_s, agent_deadline_s=agent.deadline_s,
        agent_backend=agent.backend,
        endpoint_host=agent.endpoint_host, endpoint_port=agent.endpoint_port)


def rollout_settings(cfg: MegappoConfig) -> RolloutSettings:
    """The rollout engine's deployment settings (`megappo.rollout.settings`)."""
    arr = cfg.actor_rollout_ref
    r, model = arr.rollout, arr.model
    adapter = served_adapter(model.lora, r.lora_sync, AdapterServing)
    return RolloutSettings(
        name=r.name, model_path=model.path, trust_remote_code=model.trust_remote_code, seed=cfg.data.seed,
        hybrid_engine=arr.hybrid_engine, max_num_seqs=r.max_num_seqs, engine_kwargs=engine_kwargs(r),
        dtype=r.dtype, tensor_model_parallel_size=r.tensor_model_parallel_size,
        gpu_memory_utilization=r.gpu_memory_utilization, server_urls=tuple(r.server_urls),
        servers_per_node=r.servers_per_node, server_python=_path(r.server_python), server_host=r.server_host,
        server_start_timeout_s=r.server_start_timeout_s, request_timeout_s=r.request_timeout_s,
        health_check_interval_s=r.health_check_interval_s, health_check_timeout_s=r.health_check_timeout_s,
        restart_failed_servers=r.restart_failed_servers, router=r.router, router_policy=r.router_policy,
        router_python=_path(r.router_python), api_key=r.api_key, api_key_file=r.api_key_file,
        sync_timeout_s=r.sync_timeout_s, weight_sync_master_address=r.weight_sync_master_address,
        lora_adapter=adapter, routed_experts=r.enable_rollout_routing_replay,
        mode=registry.deployment_mode(r.name, r.mode), enforce_eager=r.enforce_eager,
        max_num_batched_tokens=r.max_num_batched_tokens, max_model_len=r.max_model_len or _total_length(r),
        free_cache_engine=r.free_cache_engine,
        log_dir=os.path.join(os.path.abspath(_path(local)), "servers") if (local := cfg.trainer.default_local_dir)
        else None)


def _path(path: Optional[str]) -> Optional[str]:
    """A path of the config as every other one is read: `~` expanded (a bare name, `python3`, stays one)."""
    return os.path.expanduser(path) if path else path


def engine_kwargs(r: Any) -> dict:
    """rollout.engine_kwargs for engine `r.name`: flat, or verl's layout, a section per engine ({vllm: {...},
    sglang: {...}}), of which the engine's own."""
    kw = dict(r.engine_kwargs or {})
    if kw and set(kw) <= set(registry.engine_names()) and all(isinstance(v, dict) or v is None for v in kw.values()):
        return dict(kw.get(r.name) or {})
    return kw


def _total_length(r: Any) -> Optional[int]:
    """prompt_length + response_length once both are resolved (the engine's context length by default)."""
    return r.prompt_length + r.response_length if r.prompt_length and r.response_length else None


def lora_settings(lora: Any, seed: int = 0) -> LoRASettings:
    """A `model.lora` section (`LoRAConfig`) as the adapter layers take it; `seed` draws their initialisation."""
    return LoRASettings(rank=int(lora.rank), alpha=float(lora.alpha), dropout=float(lora.dropout),
                        target_modules=tuple(lora.target_modules), exclude_modules=tuple(lora.exclude_modules),
                        a_init=lora.lora_A_init_method, seed=seed)
