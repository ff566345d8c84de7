"""The verdict parser of recipes/gsm8k/qwen2.5-3b_grpo_genrm.yaml (reward_model.judge.parser): the GenRM answers
with \\boxed{True} or \\boxed{False} after its critique, as verl's GenRM example asks of it."""
from __future__ import annotations

import re
from typing import Optional

_BOXED = re.compile(r"\\boxed\{\s*(True|False)\s*\}")


def boxed_true_false(verdict: str) -> Optional[float]:
    """1.0 for the last \\boxed{True}, 0.0 for \\boxed{False}; None (unparsed) without one."""
    found = _BOXED.findall(verdict)
    if not found:
        return None
    return 1.0 if found[-1] == "True" else 0.0
