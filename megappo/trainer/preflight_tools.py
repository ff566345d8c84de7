"""The preflight's multi-turn checks: every configured tool class imports and its schema is well formed (before
the warm start and the model load), and the chat template shows the model its tools."""
from __future__ import annotations

import os

from megappo.config import MegappoConfig

_P = "actor_rollout_ref.rollout.multi_turn"


def check_multi_turn_tools(cfg: MegappoConfig, errors: list[str], check_files: bool, synthetic: bool) -> None:
    """Append each problem to `errors`. The tool config is checked wherever it exists (it is part of the recipe,
    not of the machine); the chat template when the files are checked and the tokenizer is a local folder (a
    synthetic task's tokenizer is made later: the rollout's loop checks it then)."""
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    if not mt.enable or not mt.tool_config_path or not os.path.isfile(os.path.expanduser(mt.tool_config_path)):
        return  # off, or validate already named the missing file
    from megappo.multi_turn.tools import ToolConfigError, check_tools, tool_schemas

    try:
        check_tools(mt)
    except ToolConfigError as e:
        errors.append(f"{_P}.tool_config_path: {e}")
        return
    tok_path = cfg.data.tokenizer or cfg.actor_rollout_ref.model.tokenizer_path
    if check_files and not synthetic and tok_path and os.path.isdir(os.path.expanduser(tok_path)):
        problem = _template_problem(os.path.expanduser(tok_path), tool_schemas(mt.tool_config_path),
                                    cfg.actor_rollout_ref.model.trust_remote_code)
        if problem:
            errors.append(f"{_P}.enable: {problem}")


def _template_problem(tok_path: str, schemas, trust_remote_code: bool):
    from transformers import AutoTokenizer

    from megappo.chat.template import template_tools_problem

    try:
        tokenizer = AutoTokenizer.from_pretrained(tok_path, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - an unreadable tokenizer is the model checks' to report
        return None
    return template_tools_problem(tokenizer, schemas)
