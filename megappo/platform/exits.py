"""How a run ends on purpose: the exception every layer may raise to stop it, and the exit code that says so.

Standard library only: the reward watch, the multi-turn health check and the trainer all stop a run the same way,
and `megappo train` tells a stopped run from a failed one by this exception alone.
"""
from __future__ import annotations


class RunStopped(RuntimeError):
    """The trainer ended the run on purpose (KL guard out of retries, a failing reward function); the message says
    why and what to change. `megappo train` prints it without a traceback and exits with EXIT_STOPPED."""


EXIT_STOPPED = 3
