"""A bounded pool for tool calls, each with a deadline: a slow call never holds its caller past its timeout.

    pool = ToolPool(load_tools(path), max_workers=8)            # or backend="ray"
    fut = pool.submit("code_interpreter", "traj-3", {"code": "print(1)"})
    result = pool.result(fut)                                    # a ToolResult by the call's deadline, always

Backends:
- "thread" (default): `max_workers` threads call `tool.execute` in this process. The built-in Python tool's thread
  only waits for a sandboxed process (killed at its own timeout), so threads are enough. A call past its deadline
  is answered with a timeout ToolResult; a custom tool that hangs in Python code keeps its thread until it
  returns (a thread cannot be killed), which `stuck_calls` counts.
- "ray": `max_workers` Ray actors, each with its own copy of the tools (pickled; the Python tool's sandbox
  starts again in the actor). An instance's calls go to one actor (its state stays there); an actor runs up to
  16 calls at once. A call past its deadline has its actor killed (its sandbox and every call in it go with it:
  the sandbox dies with its parent) and a fresh actor takes its place; the other calls that actor was running
  are run once more on the fresh one. A Ray started here is shut down by `close()`.

`close()` ends every call in flight: the tools' `close()` (the Python tool's sandbox kills what it runs) and the
Ray actors. No process is left.
"""
from __future__ import annotations

import concurrent.futures as cf
import signal
import threading
import time
import zlib
from typing import Any, Literal, Optional

from megappo.multi_turn.tools import BaseTool, ToolResult

_DEFAULT_TIMEOUT_S = 30.0
_GRACE_S = 5.0
_ACTOR_CONCURRENCY = 16  # calls at once on one Ray actor  # past a tool's own timeout_s: its kill, clean-up and answer


def timeout_result(name: str, seconds: float) -> ToolResult:
    return ToolResult(text=f"Error: the tool {name} did not answer within {seconds:g} s.",
                      metrics={"timeout": 1.0, "error": 1.0, "latency_s": seconds})


class ToolPool:
    def __init__(self, tools: dict[str, BaseTool], max_workers: int = 8,
                 backend: Literal["thread", "ray"] = "thread", call_timeout_s: Optional[float] = None,
                 ray_address: Optional[str] = None):
        if backend not in ("thread", "ray"):
            raise ValueError(f"tool pool backend must be thread or ray, not {backend!r}")
        if max_workers < 1:
            raise ValueError(f"tool pool max_workers must be >= 1, not {max_workers}")
        self.tools = dict(tools)
        self.backend = backend
        self.max_workers = max_workers
        self.call_timeout_s = call_timeout_s
        self._executor = cf.ThreadPoolExecutor(max_workers, thread_name_prefix="megappo-tool")
        self._lock = threading.Lock()
        self._running: set[cf.Future] = set()
        self._ray: Optional[_RayActors] = _RayActors(self.tools, max_workers, ray_address) if backend == "ray" \
            else None
        self._closed = False

    def deadline_s(self, name: str) -> float:
        """A call's deadline: `call_timeout_s`, else the tool's own timeout_s plus a grace for its clean-up."""
        if self.call_timeout_s is not None:
            return float(self.call_timeout_s)
        own = self._tool(name).config.get("timeout_s")
        return float(own) + _GRACE_S if own is not None else _DEFAULT_TIMEOUT_S

    def _tool(self, name: str) -> BaseTool:
        if name not in self.tools:
            raise KeyError(f"no tool named {name!r} (tools: {sorted(self.tools)})")
        return self.tools[name]

    # --- instance life cycle (cheap, in the caller's thread or on the instance's actor) ---------------------------
    def create(self, name: str, instance_id: str, **kwargs: Any) -> None:
        if self._ray is not None:
            self._ray.call(name, "create", instance_id, (), kwargs, self.deadline_s(name))
        else:
            self._tool(name).create(instance_id, **kwargs)

    def release(self, name: str, instance_id: str) -> None:
        if self._ray is not None:
            self._ray.call(name, "release", instance_id, (), {}, self.deadline_s(name))
        else:
            self._tool(name).release(instance_id)

    # --- calls ------------------------------------------------------------------------------------------------
    def submit(self, name: str, instance_id: str, arguments: dict) -> cf.Future:
        """Start one call; `result(future)` answers it by its deadline (measured from now)."""
        if self._closed:
            raise RuntimeError("the tool pool is closed")
        self._tool(name)
        deadline = time.monotonic() + self.deadline_s(name)
        if self._ray is not None:
            fut = self._executor.submit(self._ray.call, name, "execute", instance_id, (arguments,), {},
                                        self.deadline_s(name))
        else:
            fut = self._executor.submit(self._run, name, instance_id, arguments)
        fut.megappo_deadline, fut.megappo_tool = deadline, name  # type: ignore[attr-defined]
        with self._lock:
            self._running.add(fut)
        fut.add_done_callback(self._done)
        return fut

    def _done(self, fut: cf.Future) -> None:
        with self._lock:
            self._running.discard(fut)

    def _run(self, name: str, instance_id: str, arguments: dict) -> ToolResult:
        try:
            return self.tools[name].execute(instance_id, arguments)
        except Exception as e:  # a tool's bug is the tool's answer, not the rollout's crash
            return ToolResult(text=f"Error: the tool {name} failed: {type(e).__name__}: {e}"[:2000],
                              metrics={"error": 1.0, "sandbox_error": 1.0, "exception": 1.0})

    def result(self, fut: cf.Future) -> ToolResult:
        """The call's answer, or a timeout answer at its deadline."""
        left = fut.megappo_deadline - time.monotonic()  # type: ignore[attr-defined]
        try:
            return fut.result(timeout=max(left, 0.0))
        except cf.TimeoutError:
            return timeout_result(fut.megappo_tool, self.deadline_s(fut.megappo_tool))  # type: ignore[attr-defined]

    def execute(self, name: str, instance_id: str, arguments: dict) -> ToolResult:
        return self.result(self.submit(name, instance_id, arguments))

    def map(self, calls: list[tuple[str, str, dict]]) -> list[ToolResult]:
        """Run (name, instance_id, arguments) calls at once; answers in order, each by its own deadline."""
        return [self.result(f) for f in [self.submit(*c) for c in calls]]

    @property
    def stuck_calls(self) -> int:
        """Calls past their deadline whose thread has not returned yet."""
        now = time.monotonic()
        with self._lock:
            return sum(1 for f in self._running if f.megappo_deadline < now)  # type: ignore[attr-defined]

    # --- end ------------------------------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._ray is not None:
            self._ray.close()
        for tool in self.tools.values():  # stops what their calls still run, so the threads return
            close = getattr(tool, "close", None)
            if callable(close):
                close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "ToolPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _ToolHost:
    """A Ray actor's copy of the tools."""

    def __init__(self, tools: dict[str, BaseTool]):
        self.tools = tools

    def call(self, name: str, method: str, instance_id: str, args: tuple, kwargs: dict) -> Any:
        try:
            return getattr(self.tools[name], method)(instance_id, *args, **kwargs)
        except Exception as e:
            if method != "execute":
                raise
            return ToolResult(text=f"Error: the tool {name} failed: {type(e).__name__}: {e}"[:2000],
                              metrics={"error": 1.0, "sandbox_error": 1.0, "exception": 1.0})

    def ping(self) -> None:
        return None


class _RayActors:
    def __init__(self, tools: dict[str, BaseTool], n: int, address: Optional[str]):
        import ray

        from megappo.platform.job_signals import JOB_SIGNALS, job_signals_blocked

        self._owns_ray = False
        if not ray.is_initialized():
            # ray.init replaces the trainer's SIGTERM handler; it is put back (as the reward scorer does)
            handlers = {sig: signal.getsignal(sig) for sig in JOB_SIGNALS}
            try:
                if address is not None:
                    ray.init(address=address)
                else:
                    with job_signals_blocked():  # Ray's processes are the trainer's helpers
                        ray.init(num_cpus=max(n, 1), include_dashboard=False)
                    self._owns_ray = True
            finally:
                if threading.current_thread() is threading.main_thread():
                    for sig, h in handlers.items():
                        if h is not None and signal.getsignal(sig) is not h:
                            signal.signal(sig, h)
        self._tools_ref = ray.put(tools)
        # max_concurrency: an actor hosts several instances; their calls (threads waiting on sandboxes) run at once
        self._cls = ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)(_ToolHost)
        self._lock = threading.Lock()
        self._actors = [self._new_actor() for _ in range(n)]
        ray.get([a.ping.remote() for a in self._actors])  # started before the first deadline counts

    def _new_actor(self) -> Any:
        return self._cls.options(max_concurrency=_ACTOR_CONCURRENCY).remote(self._tools_ref)

    def _slot(self, instance_id: str) -> int:
        return zlib.crc32(str(instance_id).encode()) % len(self._actors)

    def call(self, name: str, method: str, instance_id: str, args: tuple, kwargs: dict, timeout_s: float) -> Any:
        import ray

        deadline = time.monotonic() + timeout_s
        k = self._slot(instance_id)
        for attempt in range(2):
            with self._lock:
                actor = self._actors[k]
            ref = actor.call.remote(name, method, instance_id, args, kwargs)
            try:
                return ray.get(ref, timeout=max(deadline - time.monotonic(), 0.0))
            except ray.exceptions.GetTimeoutError:
                self._replace(k, actor)  # the actor, its sandbox and what runs there go
                if method == "execute":
                    return timeout_result(name, timeout_s)
                raise TimeoutError(f"tool {name}.{method} did not answer within {timeout_s:g} s") from None
            except ray.exceptions.RayActorError as e:
                # killed for another call's timeout (the slot has a new actor): this call runs again there, once;
                # died by itself: replaced, and the call's answer says so
                if not self._replace(k, actor) and attempt == 0:
                    continue
                if method == "execute":
                    return ToolResult(text=f"Error: the tool {name}'s worker died: {e}"[:2000],
                                      metrics={"error": 1.0, "sandbox_error": 1.0, "exception": 1.0})
                raise
        raise AssertionError("unreachable")

    def _replace(self, k: int, actor: Any) -> bool:
        """Kill `actor` and put a fresh one in slot k; False where another call already did."""
        import ray

        with self._lock:
            if self._actors[k] is not actor:
                return False
            ray.kill(actor, no_restart=True)
            self._actors[k] = self._new_actor()
            return True

    def close(self) -> None:
        import ray

        for a in self._actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        self._actors = []
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False
