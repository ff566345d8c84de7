"""The rules of `reward_model.judge` (megappo/config/schema/judge.py), run by `megappo.checks`: each
message names the key, what is wrong and the fix."""
from __future__ import annotations

import os
import re
from pathlib import Path

from megappo.config.schema import MegappoConfig
from megappo.config.schema.judge import BUILTIN_PARSERS

# built-in template names (megappo/rewards/judge/templates.py holds their text; the config imports nothing else)
BUILTIN_TEMPLATES = ("default", "score", "digit_max", "pairwise")
BUILTIN_JUDGES = ("digit_max_judge",)  # megappo/tasks/digit_judge.py


def judge_errors(cfg: MegappoConfig, check_files: bool) -> list[str]:
    """Every violation of reward_model.judge's rules (none when the judge is off)."""
    j, errors = cfg.reward_model.judge, []

    def need(ok: bool, key: str, problem: str, fix: str) -> None:
        if not ok:
            errors.append(f"reward_model.judge.{key}: {problem}; {fix}")

    if not j.enable:
        return errors
    need(not cfg.reward_model.enable, "enable", "is true, and so is reward_model.enable (a discriminative reward "
         "model); a run has one reward model", "set reward_model.enable=false to judge with the generative model")
    need(bool(j.path) or bool(j.builtin), "path", "is missing (the judge model's directory)",
         "set reward_model.judge.path=HF_MODEL_DIR (or reward_model.judge.builtin=digit_max_judge)")
    need(j.builtin is None or j.builtin in BUILTIN_JUDGES, "builtin", f"unknown built-in judge {j.builtin!r}",
         f"use one of {', '.join(BUILTIN_JUDGES)} or null")
    if check_files and j.path and not j.builtin:
        folder = Path(os.path.expanduser(j.path))
        need((folder / "config.json").is_file(), "path", f"'{j.path}' " + ("has no config.json (not a Hugging Face "
             "model folder)" if folder.is_dir() else "is not a directory"),
             "point it at the judge's Hugging Face directory (config.json, weights and tokenizer)")
    user_parser = ":" in j.parser
    need(j.parser in BUILTIN_PARSERS or user_parser, "parser", f"unknown parser {j.parser!r}",
         f"use one of {', '.join(BUILTIN_PARSERS)} or your function as path/to/file.py:name")
    _template_errors(j, need)
    need(j.number_max > j.number_min, "number_max", f"must be above number_min ({j.number_min}), got "
         f"{j.number_max}", "set the range the judge is asked to score in, e.g. number_min=0 number_max=10")
    need(j.batch_size >= 1, "batch_size", f"must be >= 1, got {j.batch_size}", "use e.g. 64")
    need(j.max_new_tokens >= 1, "max_new_tokens", f"must be >= 1, got {j.max_new_tokens}", "use e.g. 64")
    need(j.call_timeout_s > 0, "call_timeout_s", f"must be > 0, got {j.call_timeout_s}", "use e.g. 120")
    need(j.max_retries >= 0, "max_retries", f"must be >= 0, got {j.max_retries}", "use e.g. 2")
    need(j.temperature >= 0, "temperature", f"must be >= 0, got {j.temperature}", "use 0 for greedy verdicts")
    fg = cfg.algorithm.filter_groups
    need(j.on_unparsed != "skip" or not fg.enable or fg.metric in ("reward", "seq_reward", "seq_final_reward"),
         "on_unparsed", "is skip with algorithm.filter_groups on a reward function's entry",
         "filter on reward, or use on_unparsed=zero")
    return errors


def _template_errors(j, need) -> None:
    if j.template in BUILTIN_TEMPLATES:
        pairwise_template = j.template == "pairwise"
        need(pairwise_template == (j.parser == "pairwise"), "template", f"the built-in {j.template!r} template "
             f"does not fit parser={j.parser}", "use template=pairwise with parser=pairwise, else default or your own")
        return
    fields = set(re.findall(r"(?<!\{)\{(\w+)\}(?!\})", j.template))
    wanted = {"response_a", "response_b"} if j.parser == "pairwise" else {"response"}
    allowed = wanted | {"question", "ground_truth"}
    missing = " and no ".join("{" + w + "}" for w in sorted(wanted - fields))
    need(wanted <= fields, "template", f"{j.template[:80]!r} has no {missing} (the judge would never see the "
         "response)",
         f"put {', '.join('{' + w + '}' for w in sorted(wanted))} in it, or name a built-in template "
         f"({', '.join(BUILTIN_TEMPLATES)})")
    need(fields <= allowed, "template", f"names {sorted(fields - allowed)}, which are not filled",
         f"use only {', '.join('{' + a + '}' for a in sorted(allowed))} (write {{{{ and }}}} for literal braces)")
