"""The phases of one PPO step, each a function of the run's state (`Run`) and the step's experience.

Every rank calls every phase (SPMD). A phase that communicates uses the process groups in `run.ps`; numbers that
describe the whole step (reward, KL, whitening statistics, GRPO groups) are reduced over the data-parallel group,
so a run's metrics and updates do not depend on how many data-parallel ranks it has.
"""
from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
import torch.distributed as dist

from megappo import algos
from megappo.algos import estimators
from megappo.algos import rollout_correction as correction
from megappo.config.derived import estimator
from megappo.models.compute import compute_log_probs, compute_values, train_step
from megappo.models.optim import gradients_allocated
from megappo.parallel import reduce_over_ranks
from megappo.platform.exits import RunStopped
from megappo.rewards.scorer import ScoreItem
from megappo.trainer import judge, settings
from megappo.trainer.dp import (
    dp_gather, dp_gather_rows, dp_max, dp_metrics, dp_sum, dp_sum_tensor, explained_variance_dp, masked_mean_dp,
)
from megappo.trainer.entropy_tokens import choose_tokens
from megappo.trainer.experience import (
    Experience, Samples, balanced_partitions, build_experience, mini_batch_blocks, mini_batches, workloads,
)
from megappo.trainer.roles import on_device
from megappo.trainer.state import Run


# ------------------------------------------------------------------------------------------------------------------
# rollout and rewards
# ------------------------------------------------------------------------------------------------------------------
def staleness(run: Run, samples: Samples) -> dict[str, float]:
    """How many weight versions (syncs) behind the engines the samples' policy is (0 in sync mode, 1 after the
    first step of one_step_off). With a critic, also how many updates the critic that values them (now, as it stands:
    GAE uses today's critic) has had since the actor that generated them was the trainer's: with
    trigger_parameter_sync_step W > 1 a batch of the current version is still up to W - 1 updates behind."""
    state = run.state
    behind = [state.weight_version - v for v in samples.weight_versions]
    tokens = samples.token_staleness(state.weight_version)  # partial rollouts: tokens of several versions
    out = {"async/staleness_mean": sum(behind) / max(len(behind), 1),
           "async/staleness_max": float(max(behind, default=0)),
           "async/token_staleness_mean": sum(tokens) / max(len(tokens), 1),
           "async/token_staleness_max": float(max(tokens, default=0))}
    if run.roles.critic is not None:
        updates = [state.step - state.version_steps.get(v, state.step) for v in samples.weight_versions]
        out.update({"async/critic_staleness_mean": sum(updates) / max(len(updates), 1),
                    "async/critic_staleness_max": float(max(updates, default=0))})
    return out


@dataclass
class RuleScores:
    """A batch's rule rewards, identical on every rank."""

    scores: list[float]  # one per sample; failure_score where the function failed
    metrics: dict[str, float]  # reward/num_failed, reward/num_timeout, reward/<extra> means
    extras: dict[str, list[float]]  # each numeric extra the function returned, per sample (NaN where it did not)
    # per sample, whether its group trains on nothing this step (a judge's unparsed verdict, on_unparsed=skip);
    # empty: none is
    skipped: list[bool] = field(default_factory=list)


def rule_scores(run: Run, samples: Samples, *, watch: bool = True) -> tuple[Optional[list[float]], dict[str, float]]:
    """Each sample's rule reward, scored once (global rank 0, in the scorer's workers) and sent to every rank.

    `watch`: count the step against reward_model.max_failure_fraction/max_failure_steps, and stop the run
    (RunStopped, on every rank) when the reward function keeps failing instead of training on failure_score."""
    scored = score_samples(run, samples, watch=watch)
    return scored.scores, scored.metrics


def score_samples(run: Run, samples: Samples, *, watch: bool = True) -> RuleScores:
    """`rule_scores` with the reward function's extras per sample (what algorithm.filter_groups may filter on)."""
    payload: list = [None]
    if dist.get_rank() == 0:
        texts = run.tokenizer.batch_decode(samples.response_ids, skip_special_tokens=True)
        # the question a judge reads (rule rewards ignore it)
        questions = judge.questions(run.tokenizer, samples) if run.judge is not None else [""] * len(texts)
        items = [ScoreItem(ds, text, gt, extra, q, uid) for ds, text, gt, extra, q, uid in
                 zip(samples.data_sources, texts, samples.ground_truths, samples.extra_infos, questions, samples.uids)]
        # a RunStopped when the judge fails the run (said on every rank)
        result = judge.score(run.scorer, items, watch)
        payload = [result if isinstance(result, RunStopped) else _payload(result, len(items))]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], RunStopped):
        raise payload[0]
    scores, metrics, errors, extras, skipped = payload[0]
    metrics.pop("reward/score_mean", None)  # reward/mean below is the same number over the step's samples
    if watch:
        _watch_reward_failures(run, metrics["reward/num_failed"] / max(len(scores), 1), errors, samples)
    return RuleScores(scores, metrics, extras, skipped if any(skipped) else [])


def _payload(result, n: int) -> tuple:
    """What rank 0 sends of a ScoreResult: scores, metrics, the first errors, extras and skipped flags."""
    if result.errors:  # the samples got failure_score; say why, so a broken reward function is seen early
        print(f"megappo train: the reward function failed on {result.num_failed} of {n} samples "
              f"({result.num_timeout} timed out), e.g. " + "; ".join(result.errors[:2]), file=sys.stderr)
    extras = {name: values.tolist() for name, values in result.extras.items()}
    skipped = result.skipped.tolist() if result.skipped is not None else []
    return result.scores.tolist(), result.metrics(prefix="reward/"), result.errors[:3], extras, skipped


def _watch_reward_failures(run: Run, fraction: float, errors: list[str], samples: Samples) -> None:
    rm = run.cfg.reward_model
    run.reward_failing_steps = run.reward_failing_steps + 1 if fraction > rm.max_failure_fraction else 0
    if run.reward_failing_steps >= rm.max_failure_steps:
        crf = run.cfg.custom_reward_function
        fn = f"{crf.path}:{crf.name}" if crf.path else \
            f"the built-in reward for data_source {sorted(set(samples.data_sources))}"
        raise RunStopped(
            f"the reward function ({fn}) failed on more than reward_model.max_failure_fraction="
            f"{rm.max_failure_fraction} of the samples for {run.reward_failing_steps} steps in a row (last step: "
            f"{fraction:.0%}), so the run stopped instead of training on reward_model.failure_score. Errors: "
            + "; ".join(errors or ["(none reported)"]) + ". Fix the function (or raise reward_model.timeout_s if "
            "they timed out) and start the same command again to resume")


def make_experience(run: Run, samples: Samples, scores: Optional[list[float]]) -> Experience:
    """This rank's samples, balanced by token workload over the data-parallel ranks in each mini-batch (a prompt's
    samples kept on one rank unless prefix sharing is off)."""
    groups = None if run.cfg.actor_rollout_ref.model.use_prefix_sharing is False else samples.uids
    b, dp, critic = run.batching, run.ps.dp_size, run.roles.critic is not None
    blocks = mini_batch_blocks(len(samples), dp, b.actor_mini_batches, b.critic_mini_batches if critic else 1)
    parts = balanced_partitions(workloads(samples), dp, groups, blocks) if run.cfg.trainer.balance_batch else \
        [list(range(len(samples)))[i::dp] for i in range(dp)]
    exp = build_experience(samples, parts[run.ps.dp_rank], run.pad_token_id)
    run.replay.place(samples, exp)  # R3: the engine's routes on the batch
    if scores is not None:
        exp.scores = torch.tensor([scores[i] for i in exp.indices], dtype=torch.float32)
    return exp


def reward_components(run: Run, exp: Experience, extras: Optional[dict[str, list[float]]]) -> None:
    """exp.reward_components [K, B]: algorithm.gdpo_reward_keys of the reward function's other numeric keys
    (`extras`, per sample of the step) for this rank's rows; a sample the function failed on gets
    reward_model.failure_score in each (as its summed score does)."""
    extras, rows = extras or {}, exp.indices
    keys = run.cfg.algorithm.gdpo_reward_keys or []
    missing = [k for k in keys if k not in extras]
    if missing:
        raise RunStopped(f"algorithm.gdpo_reward_keys names {', '.join(missing)}, which the reward function did not "
                         f"return (it returned: score{''.join(', ' + k for k in sorted(extras))}); make it return a "
                         "dict with those keys, or name the keys it returns")
    comps = torch.tensor([[extras[k][i] for i in rows] for k in keys], dtype=torch.float32).reshape(len(keys), -1)
    exp.reward_components = torch.nan_to_num(comps, nan=run.cfg.reward_model.failure_score)


def reward_model_scores(run: Run, exp: Experience) -> None:
    """The reward model's value at each response's last token is its score."""
    from megappo.models.batch import ModelBatch

    b = exp.batch
    # One padding column after every response: the value "before" it is the value at the last real token.
    rows = [b.input_ids[i, b.prompt_len - int(pl):b.prompt_len] for i, pl in enumerate(b.prompt_lengths())]
    resp = [b.input_ids[i, b.prompt_len:b.prompt_len + int(n)].tolist() + [run.pad_token_id]
            for i, n in enumerate(exp.response_lengths())]
    padded = ModelBatch.from_token_lists([r.tolist() for r in rows], resp, run.pad_token_id)
    with on_device(run.roles.reward, run.platform):
        values = compute_values(run.roles.reward.chunks, padded, parallel_state=run.ps,
                                micro=run.batching.reward_model)
    exp.scores = values.gather(1, exp.response_lengths().long().unsqueeze(1)).squeeze(1).float()


# ------------------------------------------------------------------------------------------------------------------
# log-probs and values
# ------------------------------------------------------------------------------------------------------------------
def ref_log_probs(run: Run, exp: Experience) -> None:
    with on_device(run.roles.ref, run.platform):
        exp.train.ref_log_probs, _ = compute_log_probs(
            run.roles.ref.chunks, exp.batch, parallel_state=run.ps, micro=run.batching.ref_log_prob,
            temperature=run.sampling.logprob_temperature)


def old_log_probs(run: Run, exp: Experience) -> dict[str, float]:
    """The actor's log-probs of the samples before this step's update (the PPO ratio's denominator); with
    algorithm.rollout_correction.bypass_mode, the engine's, not recomputed. For an estimator with
    needs_sum_pi_squared the same forward gives `exp.sum_pi_squared` [B, R]."""
    if run.correction.bypass_mode:  # the config refuses it with an estimator that needs sum_pi_squared
        exp.train.old_log_probs = exp.rollout_log_probs.clone()
        return {}
    with_sq = estimator(run.cfg).needs_sum_pi_squared
    quantile = run.cfg.actor_rollout_ref.actor.policy_loss.top_entropy_quantile  # < 1: choose tokens by entropy
    run.replay.before_old_log_probs()
    out = compute_log_probs(
        run.roles.actor.chunks, exp.batch, parallel_state=run.ps, micro=run.batching.old_log_prob,
        temperature=run.sampling.logprob_temperature, calculate_sum_pi_squared=with_sq, calculate_entropy=quantile < 1)
    replayed = run.replay.after_old_log_probs(exp)  # R2: the routes recorded; R3: the routers' agreement
    exp.train.old_log_probs = out[0]
    if with_sq:
        exp.sum_pi_squared = out[2]
    diff = (exp.rollout_log_probs - exp.train.old_log_probs).abs() * exp.mask
    metrics = {"rollout/logprob_diff_mean": masked_mean_dp(diff, exp.mask, run.ps),
               "rollout/logprob_diff_max": dp_max(float(diff.max()) if diff.numel() else 0.0, run.ps), **replayed}
    return metrics if quantile >= 1 else {**metrics, **choose_tokens(exp, out[1], quantile, run.ps)}


def values(run: Run, exp: Experience) -> None:
    exp.train.values = compute_values(run.roles.critic.chunks, exp.batch, parallel_state=run.ps,
                                      micro=run.batching.values)


# ------------------------------------------------------------------------------------------------------------------
# rewards and advantages
# ------------------------------------------------------------------------------------------------------------------
def token_rewards(run: Run, exp: Experience) -> dict[str, float]:
    """The score at each response's last token, minus kl_coef * KL(old || ref) per token when
    algorithm.use_kl_in_reward; the KL controller is updated with the step's mean KL."""
    alg, mask = run.cfg.algorithm, exp.mask
    last = exp.last_scored_index().long().unsqueeze(1)
    scores = torch.zeros_like(mask, dtype=torch.float32).scatter(1, last, exp.scores.unsqueeze(1)) * mask
    metrics: dict[str, float] = {}
    t = exp.train
    if t.ref_log_probs is not None:
        kind = alg.kl_penalty if alg.use_kl_in_reward else "kl"
        kld = algos.kl_penalty(t.old_log_probs, t.ref_log_probs, kind) * mask
        seq_kl = algos.masked_mean(kld, mask, dim=-1)
        total, count = dp_sum([float(seq_kl[mask.any(-1)].sum()), float(mask.any(-1).sum())], run.ps)
        metrics["kl/mean"] = total / max(count, 1.0)
        if alg.use_kl_in_reward:
            beta = run.kl_ctrl.value
            scores = scores - beta * kld
            metrics["kl/coef"] = beta
            run.kl_ctrl.update(metrics["kl/mean"], n_steps=int(count))
    exp.token_rewards = scores
    return metrics


def rollout_correction(run: Run, exp: Experience) -> dict[str, float]:
    """Off-policy correction between the engine's policy and the old one (algorithm.rollout_correction, verl's
    place for it: after the in-reward KL, before advantages): importance weights for the actor loss, tokens rejected
    from the response mask (so from advantages, losses and token counts too), and the `rollout_corr/*` diagnostics,
    which are logged every step (with bypass_mode the loss computes them per micro-batch instead)."""
    corr = run.correction
    if corr.bypass_mode:
        return {}
    t = exp.train
    if corr.rollout_is is None and corr.rollout_rs is None:
        local = correction.compute_rollout_corr_metrics(t.old_log_probs, exp.rollout_log_probs, exp.mask)
    else:
        weights, mask, local = correction.compute_rollout_correction(
            t.old_log_probs, exp.rollout_log_probs, exp.mask, corr, sum_across=dp_sum_tensor(run.ps))
        t.rollout_is_weights = weights
        exp.batch.response_mask = mask
    return dp_metrics(local, run.ps)


def greedy_baselines(run: Run, samples: Samples, exp: Experience) -> dict[str, float]:
    """ReMax's baselines (estimators with needs_greedy_baseline): one greedy response per prompt of the step, from
    the engine that sampled it, scored by the rule reward; each sample's baseline is its prompt's score."""
    first: dict[int, int] = {}
    for i, uid in enumerate(samples.uids):
        first.setdefault(uid, i)
    rows = list(first.values())
    prompts = _prompt_batch(samples, rows, run.pad_token_id)
    params = replace(run.sampling, greedy=True, n=1)
    greedy = run.rollout.generate(prompts, params)
    scores, _ = rule_scores(run, greedy, watch=False)
    by_uid = {samples.uids[r]: s for r, s in zip(rows, scores)}
    exp.baselines = torch.tensor([by_uid[samples.uids[i]] for i in exp.indices], dtype=torch.float32)
    return {"reward/greedy_baseline_mean": sum(scores) / max(len(scores), 1)}


def _prompt_batch(samples: Samples, rows: list[int], pad_token_id: int):
    """The prompts of `rows` of the step's samples as a left-padded PromptBatch."""
    from megappo.data.dataset import PromptBatch

    ids = [samples.prompt_ids[r] for r in rows]
    width = max((len(x) for x in ids), default=0)
    input_ids = torch.full((len(ids), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(ids), width), dtype=torch.long)
    for k, x in enumerate(ids):
        if x:
            input_ids[k, width - len(x):] = torch.as_tensor(x)
            attention[k, width - len(x):] = 1
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    pick = lambda name: [getattr(samples, name)[r] for r in rows]  # noqa: E731
    return PromptBatch(input_ids, attention, position_ids, [[] for _ in rows], pick("data_sources"),
                       pick("ground_truths"), pick("extra_infos"), ["" for _ in rows],
                       torch.as_tensor(pick("dataset_indices"), dtype=torch.long))


def advantages(run: Run, exp: Experience) -> None:
    """algorithm.adv_estimator's advantages and returns (megappo/algos/estimators.py). An outcome estimator sees the
    sequence scores of every data-parallel rank (a prompt's group may be spread over them); a token estimator runs
    on this rank's rows with the step's statistics summed over the ranks, but the optimal token baselines
    (needs_sum_pi_squared), which compare a group's tokens, see every rank's rows."""
    spec, p, mask, t = estimator(run.cfg), settings.estimator_params(run.cfg), exp.mask, exp.train
    sum_across = dp_sum_tensor(run.ps)
    if spec.needs_sum_pi_squared:
        t.advantages, t.returns = _token_baseline_advantages(run, exp, spec, p)
        return
    if spec.kind == "token":
        adv, returns = spec.fn(exp.token_rewards, mask, t.values, exp.baselines, p, sum_across)
        t.advantages, t.returns = adv * mask, returns * mask
        return
    seq = exp.token_rewards.sum(-1)
    if spec.needs_reward_components:  # gdpo: its components instead of the summed score
        seq = exp.reward_components
    all_seq, all_uid = dp_gather_rows(seq, run.ps), dp_gather(exp.uids, run.ps)
    # lengths from the loss mask (the model's own tokens), not the attention mask: tool answers are no response
    all_len = dp_gather(mask.sum(-1).float(), run.ps)
    adv = spec.fn(all_seq, all_uid, all_len, p)
    mine = adv.view(run.ps.dp_size, -1)[run.ps.dp_rank]
    t.advantages, t.returns = estimators.outcome_to_tokens(spec, mine, mask, sum_across)


def _token_baseline_advantages(run: Run, exp: Experience, spec, p) -> tuple[torch.Tensor, torch.Tensor]:
    """An estimator with needs_sum_pi_squared on every data-parallel rank's rows, its (advantages, returns) [B, R]
    for this rank's: each rank's [B, R] inputs (rollout IS weights too, when there are any), zero-padded to the
    step's longest response, gathered in rank order in one collective, as the outcome estimators' scores."""
    ps, mask, t = run.ps, exp.mask, exp.train
    b, r = mask.shape
    weights = t.rollout_is_weights
    inputs = [exp.token_rewards, mask, t.old_log_probs, exp.sum_pi_squared] + ([] if weights is None else [weights])
    width = int(dp_max(r, ps))
    rows = dp_gather(torch.nn.functional.pad(torch.stack([x.float() for x in inputs], 1), (0, width - r)), ps)
    rewards, m, old, sq = rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3]  # [N, width] each
    adv, ret = estimators.compute_advantages(spec, rewards, m, p, group_ids=dp_gather(exp.uids, ps),
                                             old_log_probs=old, sum_pi_squared=sq,
                                             is_weights=None if weights is None else rows[:, 4])
    mine = slice(ps.dp_rank * b, (ps.dp_rank + 1) * b)
    return adv[mine, :r] * mask, ret[mine, :r] * mask


# ------------------------------------------------------------------------------------------------------------------
# updates
# ------------------------------------------------------------------------------------------------------------------
def _train(run: Run, role, exp: Experience, loss_fn, micro, *, count: int, epochs: int, shuffle: bool, step: int,
           prefix: str, lm: bool, kl_stop: Optional[float] = None) -> dict[str, float]:
    """`epochs` passes of `count` optimizer steps over the experience; with `kl_stop`, the remaining epochs are
    skipped once an epoch's mean ppo_kl passes it (the metric is identical on every rank, so all stop together)."""
    history: dict[str, list[float]] = defaultdict(list)
    lr, skipped = 0.0, 0
    for epoch in range(epochs):
        seed = run.batching.shuffle_seed * 1_000_003 + step * 1009 + epoch
        epoch_kl = []
        for idx in mini_batches(exp.batch.batch_size, count, shuffle=shuffle, seed=seed):
            m = train_step(role.chunks, role.optimizer, role.scheduler, exp.batch.select(idx), loss_fn,
                           parallel_state=run.ps, micro=micro, calculate_entropy=lm,
                           temperature=run.sampling.logprob_temperature if lm else 1.0, platform=run.platform)
            for k, v in m.metrics.items():  # a loss's own namespaced metrics (rollout_corr/*) keep their names
                history[k if "/" in k else f"{prefix}/{k}"].append(v)
            history[f"{prefix}/grad_norm"].append(m.grad_norm)
            history[f"{prefix}/update_skipped"].append(0.0 if m.update_successful else 1.0)
            epoch_kl.append(m.metrics.get("ppo_kl", 0.0))
            lr = m.lr
        if kl_stop is not None and epoch + 1 < epochs and sum(epoch_kl) / len(epoch_kl) > kl_stop:
            skipped = epochs - epoch - 1
            break
    out = {k: sum(v) / len(v) for k, v in history.items()}
    out[f"{prefix}/lr"] = lr
    if kl_stop is not None:
        out["guard/epochs_skipped"] = float(skipped)
    return out


def update_critic(run: Run, exp: Experience, step: int) -> dict[str, float]:
    b = run.batching
    with gradients_allocated(run.roles.critic.chunks):  # freed between updates: the actor's update has the memory
        metrics = _train(run, run.roles.critic, exp, run.critic_loss, b.critic_train, count=b.critic_mini_batches,
                         epochs=b.critic_epochs, shuffle=b.critic_shuffle, step=step, prefix="critic", lm=False)
    metrics["critic/vf_explained_var"] = explained_variance_dp(exp.train.returns, exp.train.values, exp.mask, run.ps)
    return metrics


def update_actor(run: Run, exp: Experience, step: int) -> dict[str, float]:
    b = run.batching
    with gradients_allocated(run.roles.actor.chunks):
        return _train(run, run.roles.actor, exp, run.actor_loss, b.actor_train, count=b.actor_mini_batches,
                      epochs=b.actor_epochs, shuffle=b.actor_shuffle, step=step, prefix="actor", lm=True,
                      kl_stop=run.guard.epoch_kl_stop)


def guard_verdict(run: Run, metrics: dict[str, float], step: int) -> Optional[str]:
    """The KL guard's reason to undo this step (None: keep it), agreed by every rank: the metrics are reduced to
    the same numbers everywhere, but a rank that disagreed would leave the others in a collective."""
    reason = run.guard.check(metrics, step)
    if reduce_over_ranks([1 if reason else 0], dist.ReduceOp.MAX)[0] and reason is None:
        reason = "another rank's metrics tripped the guard"
    return reason


def sync_weights(run: Run) -> dict[str, float]:
    version = run.state.weight_version + 1
    metrics = run.rollout.sync_weights(run.roles.actor.chunks, run.roles.hf_config, version)
    run.state.synced(version, run.state.step + 1)  # during step state.step + 1, after its update
    if run.cfg.actor_rollout_ref.rollout.verify_sync:
        metrics.update(verify_sync(run))
    return metrics


def release_engine(run: Run, step: int) -> None:
    """rollout.free_cache_engine: the engine's weights are freed for the rest of the step (the updates' peak), when
    this step's weight sync will refill them: a step that updates the actor (past critic_warmup), in sync mode
    (the async modes keep the engine generating)."""
    if step > run.cfg.trainer.critic_warmup and run.cfg.async_training.mode == "sync":
        run.rollout.release_engine()


def refill_engine(run: Run) -> None:
    """An engine released for the step (`release_engine`) whose sync was skipped (the run stops after the step)
    and that still has to generate (validation before the save) gets the actor's weights under the current
    version; collective, a no-op (one small reduction) otherwise."""
    if reduce_over_ranks([1 if run.rollout.engine_released else 0], dist.ReduceOp.MAX)[0]:
        run.rollout.sync_weights(run.roles.actor.chunks, run.roles.hf_config, run.state.weight_version)


def skip_sync(run: Run) -> dict[str, float]:
    """The sync of a run that saves and stops after this step: the weights get their version number (the
    checkpoint records it) but go nowhere (`RolloutWorker.skip_sync`). An engine released for the step
    (`release_engine`) stays so; `refill_engine` gives it weights should it generate before the run stops."""
    run.state.synced(run.state.weight_version + 1, run.state.step + 1)
    return run.rollout.skip_sync(run.state.weight_version)


def verify_sync(run: Run, length: int = 16) -> dict[str, float]:
    """rollout.verify_sync: the engines' log-probs of fixed tokens equal the actor's (the trainer's forward), else
    RuntimeError on every rank, naming the difference: weights that went to the wrong place, a missed bucket, a
    dtype mix-up all show here."""
    from megappo.models.batch import ModelBatch

    hf = run.roles.hf_config
    vocab = int(hf.get("vocab_size") or hf["text_config"]["vocab_size"])  # a VLM nests it (transformers 5)
    tokens = [(7 * k + 3) % vocab for k in range(length)]
    batch = ModelBatch.from_token_lists([tokens[:1]], [tokens[1:]], run.pad_token_id)
    mine, _ = compute_log_probs(run.roles.actor.chunks, batch, parallel_state=run.ps)
    payload = [0.0]
    if dist.get_rank() == 0:
        theirs = torch.tensor(run.rollout.engine_log_probs(tokens), dtype=torch.float32)
        payload = [float((theirs - mine[0, :length - 1].float()).abs().max())]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(payload, src=0)
    diff = payload[0]
    ro = run.cfg.actor_rollout_ref.rollout
    atol = ro.verify_sync_atol or (1e-3 if run.platform.dtype == torch.float32 else 5e-2)
    if not diff <= atol:
        raise RuntimeError(f"rollout.verify_sync: after syncing weight version {run.state.weight_version}, the "
                           f"rollout engine's log-probs differ from the trainer's by {diff:.3g} (> {atol}): the "
                           "engine does not hold the actor's weights. Check the weight sync mode "
                           "(actor_rollout_ref.rollout.weight_sync) and the model's name mapping")
    return {"rollout/verify_sync_max_diff": diff}


# ------------------------------------------------------------------------------------------------------------------
# metrics and validation
# ------------------------------------------------------------------------------------------------------------------
def step_metrics(run: Run, exp: Experience) -> dict[str, float]:
    """reward/*, response/*, advantage and return summaries of the whole step; reward/* over the samples trained on
    (a dropped failed episode's reward says nothing of the policy)."""
    scores, dropped = dp_gather(exp.scores, run.ps), dp_gather(exp.dropped.float(), run.ps) > 0
    if dropped.any() and not dropped.all():
        scores = scores[~dropped]
    lengths = dp_gather(exp.response_lengths().float(), run.ps)
    truncated = dp_gather(exp.truncated.float(), run.ps)
    mask = exp.mask
    return {
        "reward/mean": float(scores.mean()), "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
        "reward/max": float(scores.max()), "reward/min": float(scores.min()),
        "response/length_mean": float(lengths.mean()), "response/length_max": float(lengths.max()),
        "response/clip_ratio": float(truncated.mean()),
        "advantages/mean": masked_mean_dp(exp.train.advantages, mask, run.ps),
        "returns/mean": masked_mean_dp(exp.train.returns, mask, run.ps),
    }


def validate(run: Run, val_batches) -> dict[str, float]:
    """Generate with `rollout.val_kwargs` (greedy by default) on the validation prompts; mean score per source (the
    judge's, where reward_model.judge scores the source; then also the rule reward beside it,
    val/judge/rule_score_mean)."""
    refill_engine(run)
    params = settings.sampling(run.cfg, validate=True, seed=run.cfg.data.seed)
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])  # score sum, length sum, count
    offset = 0  # every validation prompt its own seeds, whatever val_batch_size splits them into
    rule = []  # a judge's batches: the judged samples' rule reward beside its verdicts (reward/rule_score_mean)
    for prompts in val_batches:
        samples = run.rollout.generate(prompts, params, prompt_offset=offset)
        offset += len(prompts)
        scores, metrics = rule_scores(run, samples, watch=False)
        for ds, s, r in zip(samples.data_sources, scores, samples.response_ids):
            t = totals[ds]
            t[0], t[1], t[2] = t[0] + s, t[1] + len(r), t[2] + 1
        if "reward/rule_score_mean" in metrics:
            rule.append((metrics["reward/rule_score_mean"], len(samples)))
    out = {"val/judge/rule_score_mean": sum(m * n for m, n in rule) / sum(n for _, n in rule)} if rule else {}
    for ds, (s, n_tokens, n) in sorted(totals.items()):
        out[f"val/{ds}/reward_mean"] = s / n
        out[f"val/{ds}/response_length_mean"] = n_tokens / n
    return out
