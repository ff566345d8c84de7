"""The one shape of a config rule's message, shared by every rule set (the config's own, the capabilities'
`checks.py`, the trainer's preflight): plain Python, so the config package may import it without loading torch."""
from __future__ import annotations


def need(errors: list[str], ok: bool, key: str, problem: str, fix: str) -> None:
    """Unless `ok`, one ConfigError line: the key, what is wrong with it, the fix."""
    if not ok:
        errors.append(f"{key}: {problem}; {fix}")
