"""The rollout-and-score phase of a step, with DAPO's two changes to it (verl's DAPO recipe and reward manager).

- Overlong reward shaping (reward_model.overlong_buffer): a response in the last `len` tokens of
  data.max_response_length loses up to penalty_factor, linearly in how far it got into that buffer.
- Dynamic sampling (algorithm.filter_groups): prompt groups whose responses all have the same metric carry no
  group-relative signal and are dropped; generation batches are generated and scored until data.train_batch_size
  prompts are kept, and the step trains on exactly the first train_batch_size of them (verl trims the surplus).

Exactly resumable: every generation batch comes from the data loader (whose checkpointed position counts every
batch a step consumed) and is sampled with a seed of its step and its index within the step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

from megappo.platform.exits import RunStopped
from megappo.trainer import phases
from megappo.trainer.experience import Samples
from megappo.trainer.metrics import Timer
from megappo.trainer.rollout_source import RolloutSource
from megappo.trainer.state import Run

# metric names that read the sequence score itself (verl: "reward" in 0.9.1, seq_reward / seq_final_reward in its
# DAPO recipe; without an in-reward KL, which filtering refuses, the three are the same number)
SCORE_METRICS = ("reward", "seq_reward", "seq_final_reward")


@dataclass
class Scored:
    """A step's samples and their sequence scores (None with a reward model, which scores later)."""

    samples: Samples
    scores: Optional[list[float]]
    metrics: dict[str, float]  # rollout, staleness and dynamic-sampling metrics
    reward_metrics: dict[str, float]  # reward/* of the reward function and the overlong penalty
    extras: Optional[dict[str, list[float]]] = None  # the reward function's other numeric keys, per sample (gdpo)


def rollout_and_score(run: Run, source: RolloutSource, step: int, timer: Timer) -> Scored:
    """Generate and score the samples step `step` trains on (timed as `rollout` and `reward`); collective."""
    if run.cfg.algorithm.filter_groups.enable:
        return _filtered(run, source, step, timer)
    with timer("rollout"):
        samples, metrics = source.take(step)
        metrics.update(phases.staleness(run, samples))
        metrics.update(_turn_metrics(run, samples))
    with timer("reward"):
        scores, reward_metrics, scored = _score(run, samples)
    if scored is not None and scored.skipped:
        samples = without_training(samples, scored.skipped)
    samples, scores = failed_episodes(run, samples, scores)
    return Scored(samples, scores, metrics, reward_metrics, scored.extras if scored else None)


def without_training(samples: Samples, skipped: list[bool]) -> Samples:
    """The samples with nothing of the `skipped` ones trained on (a judge's unparsed verdict in their group,
    reward_model.judge.on_unparsed=skip): their loss masks are all 0, so they add no token to a loss, a token count
    or an advantage's statistics, while the batch keeps its size (mini-batches and data-parallel shares stay
    even). Called after the step's turn metrics and tool rewards, which read the loss masks as multi-turn's."""
    masks = [[0] * len(r) if skip else m for r, m, skip in zip(samples.response_ids, samples.loss_masks, skipped)]
    return replace(samples, loss_masks=masks)


def _turn_metrics(run: Run, samples: Samples) -> dict[str, float]:
    """multi_turn/*, tool/* and episodes/* of multi-turn samples ({} for single-turn ones); broken tools and
    failing agents or environments are warned of on the console and stop the run when they keep failing
    (RunStopped, on every rank: every rank has the samples)."""
    if not samples.multi_turn:
        return {}
    import torch.distributed as dist

    from megappo.envs.failures import FailureWatch, episode_failure, failure_metrics
    from megappo.envs.metrics import multi_turn_metrics
    from megappo.multi_turn.health import ToolWatch, watch_tools

    metrics = multi_turn_metrics(samples.turn_stats, samples.tool_results)
    if run.tool_watch is None:
        mt = run.cfg.actor_rollout_ref.rollout.multi_turn
        run.tool_watch = ToolWatch(mt.max_tool_failure_fraction, mt.max_tool_failure_steps, speak=dist.get_rank() == 0)
    watch_tools(run.tool_watch, metrics, samples.tool_results)
    failures = [episode_failure(s) for s in samples.turn_stats]
    metrics.update(failure_metrics(failures))
    if run.failure_watch is None:
        agent = run.cfg.actor_rollout_ref.rollout.agent
        run.failure_watch = FailureWatch(agent.max_failure_fraction, agent.max_failure_steps, agent.on_failure,
                                         log_dir=run.cfg.trainer.default_local_dir, speak=dist.get_rank() == 0)
    reason = run.failure_watch.step(samples.turn_stats, failures)
    if reason:
        raise RunStopped(reason)
    return metrics


def failed_episodes(run: Run, samples: Samples, scores: Optional[list[float]]
                    ) -> tuple[Samples, Optional[list[float]]]:
    """rollout.agent.on_failure on the step's failed episodes (`megappo.envs.failures`). drop: nothing of them is
    trained on (`without_training`), each is a group of its own (so its prompt's other samples are normalised
    without it) and reward/* leaves it out; zero_reward: its score is 0; keep: as it is."""
    from megappo.envs.failures import episode_failure

    failed = [episode_failure(s) is not None for s in samples.turn_stats]
    policy = run.cfg.actor_rollout_ref.rollout.agent.on_failure
    if not any(failed) or policy == "keep":
        return samples, scores
    if policy == "zero_reward":
        return samples, None if scores is None else [0.0 if f else x for x, f in zip(scores, failed)]
    fresh = iter(range(max(samples.uids, default=0) + 1, 1 << 62))
    samples = replace(without_training(samples, failed), dropped=list(failed),
                      uids=[next(fresh) if f else uid for uid, f in zip(samples.uids, failed)])
    return samples, scores


def overlong_penalties(lengths: list[int], max_response_length: int, buffer_len: int, factor: float) -> list[float]:
    """verl's DAPO overlong penalty of each response length: min(-(L - (max - len)) / len * factor, 0)."""
    expected = max_response_length - buffer_len
    return [min(-(n - expected) / buffer_len * factor, 0.0) for n in lengths]


def _score(run: Run, samples: Samples) -> tuple[Optional[list[float]], dict[str, float], Optional[phases.RuleScores]]:
    """(scores with the overlong penalty, reward metrics, the raw rule scores)."""
    if run.cfg.reward_model.enable:
        return None, {}, None
    scored = phases.score_samples(run, samples)
    if samples.multi_turn:  # an agent program's own reward; the tools' own rewards add to the step reward
        source = run.cfg.actor_rollout_ref.rollout.agent.reward_source
        scores = episode_rewards(scored.scores, samples.turn_stats, source)
        scored = replace(scored, scores=[s + (t["tool_reward"] if t else 0.0)
                                         for s, t in zip(scores, samples.turn_stats)])
    ob = run.cfg.reward_model.overlong_buffer
    if not ob.enable:
        return scored.scores, scored.metrics, scored
    penalties = overlong_penalties([len(r) for r in samples.response_ids], run.cfg.data.max_response_length,
                                   ob.len, ob.penalty_factor)
    metrics = dict(scored.metrics)
    metrics["reward/overlong_penalty_mean"] = sum(penalties) / max(len(penalties), 1)
    metrics["reward/overlong_fraction"] = sum(p < 0 for p in penalties) / max(len(penalties), 1)
    return [s + p for s, p in zip(scored.scores, penalties)], metrics, scored


def episode_rewards(rule: list[float], stats: list[Optional[dict]], source: str) -> list[float]:
    """Each sample's reward: with rollout.agent.reward_source=agent, an agent program's returned reward (its
    stats' agent_reward) where it returned one, else the rule reward."""
    if source != "agent":
        return rule
    return [r if not t or t.get("agent_reward") is None else float(t["agent_reward"]) for r, t in zip(rule, stats)]


def metric_values(name: str, scores: list[float], scored: phases.RuleScores) -> list[float]:
    """Each sample's value of algorithm.filter_groups.metric."""
    if name in SCORE_METRICS:
        return scores
    if name in scored.extras:
        return scored.extras[name]
    if name in ("score", "acc"):  # verl's DAPO manager records a float-returning function's score as "acc"
        return scored.scores
    raise RunStopped(f"algorithm.filter_groups.metric={name!r}: the reward function returned no such entry "
                     f"(it returned: score{''.join(', ' + k for k in sorted(scored.extras))}); use reward, or a "
                     "numeric key of the dict the reward function returns")


def kept_groups(uids: list[int], values: list[float]) -> list[int]:
    """The groups (uids, in order of first appearance) whose values are not all equal; a group of one is kept
    (verl's rule: std > 0 or a single sample). NaN (a failed sample) counts as a value of its own."""
    groups: dict[int, list[float]] = {}
    for uid, v in zip(uids, values):
        groups.setdefault(uid, []).append(v)
    return [uid for uid, vals in groups.items()
            if len(vals) == 1 or len({("nan" if math.isnan(v) else v) for v in vals}) > 1]


def _filtered(run: Run, source: RolloutSource, step: int, timer: Timer) -> Scored:
    fg, want = run.cfg.algorithm.filter_groups, run.cfg.data.train_batch_size
    parts: list[Samples] = []
    part_scores: list[float] = []
    part_extras: dict[str, list[float]] = {}
    all_scores: list[float] = []
    sums: dict[str, float] = {}
    kept = dropped = gen = 0
    while kept < want:
        if 0 < fg.max_num_gen_batches <= gen:
            raise RunStopped(
                f"algorithm.filter_groups: step {step} generated {gen} batches of {run.cfg.data.gen_batch_size} "
                f"prompts (max_num_gen_batches={fg.max_num_gen_batches}) and kept only {kept} of the "
                f"data.train_batch_size={want} prompts whose responses' {fg.metric} differ: the prompts are too "
                "hard or too easy for the policy. Raise algorithm.filter_groups.max_num_gen_batches (0: no limit) "
                "or data.gen_batch_size, or use other data; the run resumes from its last checkpoint")
        with timer("rollout"):
            samples, _ = source.take(step, gen_batch=gen)
        gen += 1
        with timer("reward"):
            scores, reward_metrics, scored = _score(run, samples)
        for k, v in reward_metrics.items():
            sums[k] = sums.get(k, 0.0) + v
        all_scores += scores
        keep = kept_groups(samples.uids, metric_values(fg.metric, scores, scored))
        if scored is not None and scored.skipped:  # a judge's unparsed verdict: the group is dropped, as filtered
            bad = {uid for uid, skip in zip(samples.uids, scored.skipped) if skip}
            keep = [uid for uid in keep if uid not in bad]
        dropped += len(set(samples.uids)) - len(keep)
        keep = keep[:want - kept]  # the first train_batch_size kept groups of the step, as verl trims
        chosen = set(keep)
        rows = [i for i, uid in enumerate(samples.uids) if uid in chosen]
        parts.append(samples.select(rows))
        extras = scored.extras if scored else {}
        for name in set(part_extras) | set(extras):  # a key one batch lacks is NaN there, as within a batch
            values = extras.get(name)
            part_extras.setdefault(name, [math.nan] * len(part_scores)).extend(
                values[i] if values else math.nan for i in rows)
        part_scores += [scores[i] for i in rows]
        kept += len(keep)
    merged = Samples.concat(parts)
    n = len(merged) // want
    merged = replace(merged, uids=[i // n for i in range(len(merged))])  # one GRPO group per kept prompt
    # counts add up over the generation batches; the reward function's means are averaged over them
    reward_metrics = {k: v if k.startswith("reward/num_") else v / gen for k, v in sums.items()}
    metrics = phases.staleness(run, merged)
    metrics.update(_turn_metrics(run, merged))
    metrics.update({"train/num_gen_batches": float(gen), "filter_groups/num_dropped_groups": float(dropped),
                    "filter_groups/reward_mean_all": sum(all_scores) / max(len(all_scores), 1)})
    merged, part_scores = failed_episodes(run, merged, part_scores)
    return Scored(merged, part_scores, metrics, reward_metrics, part_extras)
