"""An agent program in a process of its own per episode (`rollout.agent.backend=process`): a hung or runaway agent
is killed at its deadline (a thread cannot be), and its memory and crashes stay out of the trainer.

The child is spawned (a fresh interpreter: no state shared with the trainer), imports the agent by its
"path/to/file.py:function" or "module:function" name, calls it with the episode's address, key and row, and sends
back its result or its error. Past the deadline the child is killed; the runner answers the sample from what the
endpoint recorded, as for a thread. Spawning costs an interpreter start and the agent's imports per episode: for
agents whose episodes are long, or that must not share the trainer's process."""
from __future__ import annotations

import multiprocessing as mp
from typing import Any, Optional

from megappo.envs.base import EpisodeRow


def _child(spec: str, kwargs: dict, base_url: str, api_key: str, row: EpisodeRow, conn: Any) -> None:
    import functools
    import traceback

    from megappo.agents.runner import call_agent, resolve_agent

    try:
        conn.send((True, call_agent(functools.partial(resolve_agent(spec, kwargs), **kwargs), base_url, api_key, row)))
    except BaseException as e:  # noqa: BLE001 - the agent's failure is its sample's flag
        conn.send((False, f"{type(e).__name__}: {e}\n(in the agent's process:)\n{traceback.format_exc()[-6000:]}"))
    finally:
        conn.close()


class AgentProcessError(RuntimeError):
    """The agent raised in its process (the message is its error), or its process died without an answer."""


class ProcessAgent:
    """A callable with an agent function's signature that runs the function in a spawned process per call."""

    def __init__(self, spec: str, kwargs: Optional[dict] = None, deadline_s: float = 300.0):
        self.spec, self.kwargs, self.deadline_s = spec, dict(kwargs or {}), deadline_s
        self.context = mp.get_context("spawn")

    def __call__(self, base_url: str, api_key: str, row: EpisodeRow) -> Any:
        receive, send = self.context.Pipe(duplex=False)
        proc = self.context.Process(target=_child, args=(self.spec, self.kwargs, base_url, api_key, row, send),
                                    name="megappo-agent", daemon=True)
        proc.start()
        send.close()
        try:
            if not receive.poll(self.deadline_s):
                raise TimeoutError(f"the agent passed its {self.deadline_s:g}s deadline: its process was killed")
            try:
                ok, value = receive.recv()
            except EOFError:
                raise AgentProcessError(f"the agent's process died (exit code {proc.exitcode})") from None
            if not ok:
                raise AgentProcessError(value)
            return value
        finally:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)
            receive.close()
