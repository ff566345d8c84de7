"""The trainer's side of a generative judge (reward_model.judge): its built-in model made at setup, its engine
deployed (collective: every rank calls `deploy_judge`; rank 0's holder engine judges) and closed at teardown, and
the scorer rank 0 scores with (`JudgeScorer`, the rule scorer beside it for the sources it does not judge)."""
from __future__ import annotations

import os
from typing import Any, Optional

import torch.distributed as dist

from megappo.config.schema import MegappoConfig
from megappo.platform.exits import RunStopped
from megappo.rewards.judge import (
    JudgeParserFailing, JudgeScorer, JudgeSettings, JudgeUnparsed, LoopSettings, get_parser,
)
from megappo.rewards.judge.templates import template_text


def prepare_builtin(cfg: MegappoConfig, local_dir: str) -> None:
    """reward_model.judge.builtin: write the built-in judge (rank 0; the others wait) and point judge.path at it.
    Collective."""
    j = cfg.reward_model.judge
    if not (j.enable and j.builtin):
        return
    from megappo.tasks.digit_judge import prepare_judge

    out = [None]
    if dist.get_rank() == 0:
        out = [prepare_judge(j.builtin, os.path.join(local_dir, "synthetic", j.builtin),
                             seed=cfg.data.synthetic.seed).model_dir]
    dist.broadcast_object_list(out, src=0)
    j.path = out[0]


def deploy_judge(cfg: MegappoConfig, ps: Any, platform: Any) -> Optional[Any]:
    """The judge's deployment (collective; None when the judge is off)."""
    j = cfg.reward_model.judge
    if not j.enable:
        return None
    from megappo.rollout import registry
    from megappo.rollout.fixed import fixed_settings
    from megappo.trainer.settings import rollout_settings

    return registry.deploy(fixed_settings(rollout_settings(cfg), os.path.expanduser(j.path), j.inference), ps, platform)


def settings(cfg: MegappoConfig) -> JudgeSettings:
    """reward_model.judge as the scorer reads it."""
    j = cfg.reward_model.judge
    return JudgeSettings(
        template=template_text(j.template), pairwise=j.parser == "pairwise", use_chat_template=j.use_chat_template,
        data_sources=tuple(j.data_sources), on_unparsed=j.on_unparsed, failure_score=cfg.reward_model.failure_score,
        log_rule_score=j.log_rule_score, max_failure_fraction=cfg.reward_model.max_failure_fraction,
        max_failure_steps=cfg.reward_model.max_failure_steps,
        loop=LoopSettings(batch_size=j.batch_size, call_timeout_s=j.call_timeout_s, max_retries=j.max_retries,
                          max_new_tokens=j.max_new_tokens, temperature=j.temperature, top_p=j.top_p, seed=j.seed))


def load_parser(cfg: MegappoConfig) -> Any:
    """reward_model.judge.parser, loaded and (a user's) checked: a JudgeParserError (exit 1) names the signature the
    judge calls it with. Every rank loads it before the judge is deployed, so a broken parser stops every rank
    alike, before anything is started; the first failures' tracebacks go to the run's folder."""
    j = cfg.reward_model.judge
    return get_parser(j.parser, (j.number_min, j.number_max),
                      log_dir=os.path.expanduser(cfg.trainer.default_local_dir))


def judge_scorer(cfg: MegappoConfig, deployment: Any, rule: Any, parse: Any) -> JudgeScorer:
    """Rank 0's scorer: the judge on its holder engine, reading verdicts with `parse` (`load_parser`), `rule` (a
    RewardScorer) for the rest."""
    import transformers

    j = cfg.reward_model.judge
    if deployment.engine is None:
        raise RuntimeError("global rank 0 holds no judge engine; the judge's deployment must give the first rank of "
                           "each data-parallel replica one")
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        os.path.expanduser(j.path), trust_remote_code=cfg.actor_rollout_ref.model.trust_remote_code)
    return JudgeScorer(deployment.engine, tokenizer, parse, settings(cfg), rule)


def questions(tokenizer: Any, samples: Any) -> list[str]:
    """The question a judge reads for each sample: its dataset row's last user message, else (a sample made
    without one) its prompt decoded, once per prompt group (a chat template's role words stay in that text)."""
    first: dict[int, str] = {}
    for uid, ids, question in zip(samples.uids, samples.prompt_ids, samples.questions):
        if uid not in first:
            first[uid] = question if question is not None else tokenizer.decode(ids, skip_special_tokens=True)
    return [first[uid] for uid in samples.uids]


def score(scorer: Any, items: list, watch: bool = True) -> Any:
    """`scorer.score(items)`, or the RunStopped that ends the run when a judge's verdict does not parse under
    on_unparsed=fail, or (`watch`: a training step's scoring) a user's parser keeps failing (rank 0 judges; the
    caller sends it to every rank, which all stop with its message)."""
    try:
        return scorer.score(items, watch=watch) if isinstance(scorer, JudgeScorer) else scorer.score(items)
    except JudgeUnparsed as e:
        return RunStopped(f"{e}; the run stopped (reward_model.judge.on_unparsed=fail) and resumes from its last "
                          "checkpoint when started again")
    except JudgeParserFailing as e:
        return RunStopped(f"{e}; the run resumes from its last checkpoint when started again")
