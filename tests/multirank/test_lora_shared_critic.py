"""critic.model.lora.share_actor_base: a LoRA critic on the actor's frozen base tensors (megappo.models.lora.
share_base), built by the trainer's own `build_roles` from a recipe config.

One copy of the base: every base parameter of the critic is the actor's tensor (same storage); its values equal a
separately built LoRA critic with the same adapters and value head; the actor's and the critic's steps leave each
other's adapters (and the shared base) untouched, neither DDP nor an optimizer holds a shared parameter; the
critic's checkpoint holds its adapters and value head only and restores them.
"""
from __future__ import annotations

import pytest
import torch

from megappo.testing.dist import run_distributed

pytestmark = pytest.mark.multirank

RECIPE = "recipes/cpu/tiny_ppo_lora.yaml"


def _batch():
    from megappo.testing.batches import random_batch

    return random_batch(3, (3, 6), (5, 2), old_log_prob=-6.0)


def _actor_loss(out, ctx):
    ratio = torch.exp(out.log_probs - ctx.batch.train.old_log_probs)
    return -(ratio * ctx.batch.train.advantages * ctx.batch.response_mask).sum() / ctx.global_num_tokens, {}


def _critic_loss(out, ctx):
    err = (out.values - ctx.batch.train.returns) ** 2 * ctx.batch.response_mask
    return err.sum() / ctx.global_num_tokens, {}


def _snapshot(chunks):
    from megappo.models.builder import unwrap

    return {n: p.detach().clone() for c in chunks for n, p in unwrap(c).named_parameters()}


def _changed(before, chunks, which):
    from megappo.models.builder import unwrap

    now = {n: p.detach() for c in chunks for n, p in unwrap(c).named_parameters()}
    return sorted(n for n in before if which(n) and not torch.equal(before[n], now[n]))


def _job(rank, world_size, hf_dir, tmp):
    import os

    from megappo.config import load_config
    from megappo.config.schema import LoRAConfig
    from megappo.kinds.build import build_model
    from megappo.kinds.weights import load_hf_weights
    from megappo.models.builder import unwrap
    from megappo.models.checkpoint import load_model_checkpoint, save_model_checkpoint
    from megappo.models.compute import compute_values, train_step
    from megappo.models.lora import adapters, apply_lora, is_adapter_param
    from megappo.parallel import destroy_parallel, init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout
    from megappo.trainer.roles import build_roles, describe
    from megappo.trainer.settings import lora_settings

    plat = detect_platform()
    ps = init_parallel(ParallelLayout(), plat, seed=0)
    cfg = load_config(RECIPE, [f"actor_rollout_ref.model.path={hf_dir}", "critic.model.lora.rank=4",
                               "critic.model.lora.alpha=8", "critic.model.lora.share_actor_base=true",
                               "critic.optim.lr=5e-2", "actor_rollout_ref.actor.optim.lr=5e-2",
                               "actor_rollout_ref.actor.optim.lr_warmup_steps=0",
                               f"trainer.default_local_dir={tmp}"])
    roles = build_roles(cfg, ps, plat, total_steps=4)
    actor, critic = roles.actor, roles.critic
    out = {"describe": describe(roles, ps)}
    a_params = {n: p for c in actor.chunks for n, p in unwrap(c).named_parameters()}
    c_params = {n: p for c in critic.chunks for n, p in unwrap(c).named_parameters()}
    base = [n for n in c_params if not is_adapter_param(n) and not n.startswith("output_layer.")]
    out["base"] = len(base)
    out["shared_ptr"] = sum(c_params[n].data_ptr() == a_params[n].data_ptr() for n in base)
    out["shared_obj"] = sum(c_params[n] is a_params[n] for n in base)
    out["adapters_apart"] = not ({p.data_ptr() for n, p in c_params.items() if is_adapter_param(n)}
                                 & {p.data_ptr() for n, p in a_params.items() if is_adapter_param(n)})
    opt_ids = {id(p) for role in (actor, critic) for g in role.optimizer.param_groups for p in g["params"]}
    out["opt_shared"] = sum(id(c_params[n]) in opt_ids for n in base)
    out["opt_critic"] = sorted(n for n, p in c_params.items()
                               if id(p) in {id(q) for g in critic.optimizer.param_groups for q in g["params"]})
    out["grad_buffers_shared"] = sum(getattr(c_params[n], "main_grad", None) is not None for n in base)

    batch = _batch()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # non-zero adapters on both, so a mix-up would show
        for ad in adapters(actor.chunks) + adapters(critic.chunks):
            ad.lora_B.copy_(0.05 * torch.randn(ad.lora_B.shape, generator=g))
    values = compute_values(critic.chunks, batch, parallel_state=ps)
    # a separately built LoRA critic (its own base) with the same adapters and value head
    alone = build_model(hf_dir, "critic", ps, plat, seed=9, config_overrides={"use_transformer_engine": False})
    load_hf_weights(alone, hf_dir, ps)
    apply_lora(alone, lora_settings(LoRAConfig(rank=4, alpha=8.0)), trainable=("output_layer",))
    src = {n: p for n, p in c_params.items() if is_adapter_param(n) or n.startswith("output_layer.")}
    with torch.no_grad():
        for n, p in unwrap(alone[0]).named_parameters():
            if n in src:
                p.copy_(src[n])
    out["values_err"] = (compute_values(alone, batch, parallel_state=ps) - values).abs().max().item()
    out["values_abs"] = values.abs().max().item()

    a0, c0 = _snapshot(actor.chunks), _snapshot(critic.chunks)
    train_step(actor.chunks, actor.optimizer, actor.scheduler, batch, _actor_loss, parallel_state=ps, platform=plat)
    out["actor_step_actor"] = _changed(a0, actor.chunks, lambda n: True)
    out["actor_step_critic"] = _changed(c0, critic.chunks, lambda n: True)
    a0, c0 = _snapshot(actor.chunks), _snapshot(critic.chunks)
    train_step(critic.chunks, critic.optimizer, critic.scheduler, batch, _critic_loss, parallel_state=ps,
               platform=plat)
    out["critic_step_critic"] = _changed(c0, critic.chunks, lambda n: True)
    out["critic_step_actor"] = _changed(a0, actor.chunks, lambda n: True)

    ckpt = os.path.join(tmp, "critic_ckpt")
    save_model_checkpoint(critic.chunks, ckpt, optimizer=critic.optimizer)
    from megatron.core.dist_checkpointing import load_tensors_metadata

    out["ckpt_keys"] = sorted(load_tensors_metadata(ckpt))
    saved_values = compute_values(critic.chunks, batch, parallel_state=ps)
    train_step(critic.chunks, critic.optimizer, critic.scheduler, batch, _critic_loss, parallel_state=ps,
               platform=plat)
    load_model_checkpoint(critic.chunks, ckpt, optimizer=critic.optimizer)
    out["resume_err"] = (compute_values(critic.chunks, batch, parallel_state=ps) - saved_values).abs().max().item()
    out["still_shared"] = sum(c_params[n].data_ptr() == a_params[n].data_ptr() for n in base)
    destroy_parallel()
    return out


def test_critic_shares_the_actors_base(hf_model_dir, tmp_path):
    r = run_distributed(_job, 1, hf_model_dir("qwen2"), str(tmp_path), timeout=300)[0]
    assert r["base"] > 0 and r["shared_ptr"] == r["shared_obj"] == r["base"], "one copy of the base"
    assert r["adapters_apart"]
    assert r["opt_shared"] == 0 and r["grad_buffers_shared"] == 0
    assert r["opt_critic"] and all(".lora." in n or n.startswith("output_layer.") for n in r["opt_critic"])
    assert any("actor's base" in line for line in r["describe"]), r["describe"]
    assert r["values_abs"] > 0 and r["values_err"] <= 1e-6, r["values_err"]
    assert r["actor_step_actor"] and all(".lora." in n for n in r["actor_step_actor"])
    assert r["actor_step_critic"] == []
    assert r["critic_step_critic"] and all(".lora." in n or n.startswith("output_layer.")
                                           for n in r["critic_step_critic"])
    assert r["critic_step_actor"] == []
    assert r["ckpt_keys"] and all(".lora." in k or "output_layer." in k for k in r["ckpt_keys"]), r["ckpt_keys"][:5]
    assert r["resume_err"] == 0.0 and r["still_shared"] == r["base"]
