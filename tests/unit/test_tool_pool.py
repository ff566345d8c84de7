"""The tool pool: calls run at once, each answered by its deadline however slow the tool; close() leaves no process."""
from __future__ import annotations

import os
import threading
import time

import psutil
import pytest

from megappo.multi_turn.pool import ToolPool
from megappo.multi_turn.python_tool import PythonTool
from megappo.sandbox import SandboxUnavailable
from megappo.multi_turn.tools import BaseTool, ToolResult, load_tools

pytestmark = pytest.mark.timeout(180)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCHEMA = {"type": "function", "function": {"name": "code_interpreter", "parameters": {
    "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}


class HangingTool(BaseTool):
    """A custom tool stuck in Python code (no process to kill): only the pool's deadline answers for it."""

    def __init__(self, config, schema):
        super().__init__(config, schema)
        self.release_event = threading.Event()

    def __getstate__(self):  # to a Ray actor: a fresh event there
        return {k: v for k, v in self.__dict__.items() if k != "release_event"}

    def __setstate__(self, state):
        self.__dict__.update(state, release_event=threading.Event())

    def execute(self, instance_id, arguments):
        if arguments.get("hang"):
            self.release_event.wait(30)
        return ToolResult(text=f"echo {arguments.get('x')}")


def hang_schema(name="hang"):
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}


_BEFORE: set[int] = set()  # descendants an earlier test of the session left for life (torch's shm manager)


@pytest.fixture(autouse=True)
def _earlier_descendants():
    _BEFORE.clear()
    _BEFORE.update(p.pid for p in descendants())


def descendants() -> list[psutil.Process]:
    """This process's live descendants that the test started, but multiprocessing's resource tracker (this
    process's own, for life)."""
    found = []
    for c in psutil.Process().children(recursive=True):
        try:
            if c.pid in _BEFORE:
                continue
            if c.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(c.cmdline()):
                found.append(c)
        except psutil.NoSuchProcess:
            continue
    return found


def python_tool(**config) -> PythonTool:
    tool = PythonTool({"timeout_s": 2, "cpu_s": 2, **config}, SCHEMA)
    try:
        return tool.start()
    except SandboxUnavailable as e:
        pytest.skip(f"this machine cannot isolate the code: {e}")


def test_the_example_config_loads():
    tools = load_tools(os.path.join(REPO, "recipes/tools/python_tool.yaml"))
    assert list(tools) == ["code_interpreter"]
    tool = tools["code_interpreter"]
    assert isinstance(tool, PythonTool) and tool.limits.timeout_s == 10 and tool.max_output_chars == 4096
    assert tool.tool_schema["function"]["parameters"]["required"] == ["code"]


def test_a_slow_call_does_not_hold_the_others():
    py = python_tool()
    hang = HangingTool({}, hang_schema())
    pool = ToolPool({"code_interpreter": py, "hang": hang}, max_workers=4)
    try:
        t0 = time.monotonic()
        slow = pool.submit("code_interpreter", "a", {"code": "import time\ntime.sleep(600)"})
        fast = [pool.submit("code_interpreter", f"b{k}", {"code": f"print({k} * 2)"}) for k in range(3)]
        assert [pool.result(f).text for f in fast] == ["0\n", "2\n", "4\n"]
        assert time.monotonic() - t0 < 2.0, "fast calls waited for the slow one"
        res = pool.result(slow)
        assert "timed out after 2 s" in res.text and res.metrics["timeout"] == 1
        assert time.monotonic() - t0 < 2 + 5

        # a tool hung in Python: answered at the pool's deadline; its thread is counted as stuck
        pool.call_timeout_s = 0.5
        t1 = time.monotonic()
        res = pool.execute("hang", "c", {"hang": True})
        assert 0.5 <= time.monotonic() - t1 < 1.5
        assert res.text == "Error: the tool hang did not answer within 0.5 s." and res.metrics["timeout"] == 1
        assert pool.stuck_calls == 1
        assert pool.execute("hang", "d", {"x": 7}).text == "echo 7"  # the others still run
        hang.release_event.set()
    finally:
        pool.close()
    assert not descendants(), [(p.pid, p.ppid(), p.cmdline()) for p in descendants()]


def test_a_tool_that_raises_is_an_answer():
    class Broken(BaseTool):
        def execute(self, instance_id, arguments):
            raise RuntimeError("bug in the tool")

    with ToolPool({"broken": Broken({}, hang_schema("broken"))}, max_workers=1) as pool:
        res = pool.execute("broken", "i", {})
    assert "RuntimeError: bug in the tool" in res.text and res.metrics["error"] == 1


def test_many_calls_at_once_and_no_process_left():
    py = python_tool(max_processes=8)
    with ToolPool({"code_interpreter": py}, max_workers=4) as pool:
        calls = [("code_interpreter", f"i{k}", {"code": f"import os\nprint({k}, os.getuid() != 0)"}) for k in range(16)]
        results = pool.map(calls)
        assert [r.text for r in results] == [f"{k} True\n" for k in range(16)]
    assert not descendants(), [(p.pid, p.ppid(), p.cmdline()) for p in descendants()]


@pytest.mark.long
def test_ray_backend():
    """Calls run on Ray actors (each with its own sandbox); a call past its deadline has its actor replaced."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("a Ray is already running in this process")
    import sys

    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # HangingTool: the actors cannot import this file
    py = PythonTool({"timeout_s": 2, "cpu_s": 2}, SCHEMA)
    hang = HangingTool({}, hang_schema())
    pool = ToolPool({"code_interpreter": py, "hang": hang}, max_workers=2, backend="ray")
    try:
        results = pool.map([("code_interpreter", f"i{k}", {"code": f"print({k} + 1)"}) for k in range(4)])
        assert [r.text for r in results] == ["1\n", "2\n", "3\n", "4\n"]
        res = pool.execute("code_interpreter", "s", {"code": "import time\ntime.sleep(600)"})
        assert "timed out after 2 s" in res.text
        pool.call_timeout_s = 1.0
        t0 = time.monotonic()
        res = pool.execute("hang", "h", {"hang": True})
        assert res.metrics["timeout"] == 1 and time.monotonic() - t0 < 3.0
        pool.call_timeout_s = None
        assert pool.execute("code_interpreter", "h", {"code": "print('after')"}).text == "after\n"
    finally:
        pool.close()
    assert not ray.is_initialized()
    deadline = time.monotonic() + 20
    while descendants() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not descendants(), [(p.pid, p.ppid(), p.cmdline()) for p in descendants()]
