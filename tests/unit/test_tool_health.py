"""Broken tools are said (megappo/multi_turn/health.py): a tool that raises or an unknown tool name is warned of on
the console with the error, once per tool and kind a minute; a run whose tool calls keep failing stops with a
message saying why and what to change."""
from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

from megappo.config import load_config
from megappo.config.schema import MegappoConfig, MultiTurnConfig
from megappo.multi_turn.health import ToolWatch, watch_tools
from megappo.envs.base import EpisodeRow
from megappo.envs.metrics import multi_turn_metrics
from megappo.multi_turn.env import ToolLoop
from megappo.chat.parser import parse_hermes
from megappo.multi_turn.tools import BaseTool
from megappo.platform.exits import RunStopped
from megappo.tasks import tool_sum
from megappo.trainer import settings

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
UNKNOWN = '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
BAD = '<tool_call>{"name": "calculator", "arguments": {</tool_call>'


class Broken(BaseTool):
    def execute(self, instance_id, arguments):
        raise ZeroDivisionError("the tool's own bug")


@pytest.fixture(scope="module")
def calls(tmp_path_factory):
    """The tool results and stats of three trajectories: a call to a tool that raises, an unknown tool, a malformed
    call (each one call, as the loop records it)."""
    tok, _ = tool_sum.make_tokenizer(tool_sum.ToolTask(), str(tmp_path_factory.mktemp("tok")))
    agent = ToolLoop(mt_settings(400), tok, {"calculator": Broken({}, tool_sum.TOOL_SCHEMA)})
    results = []
    try:
        for text in (CALL, UNKNOWN, BAD):
            env = agent.make(EpisodeRow([], "", None, {}, 0))
            env.step({"role": "assistant", "content": text})
            results.append(env.info()["tool_results"])
            env.close()
    finally:
        agent.close()
    stats = [{"turns": 2.0, "budget_hit": 0.0, "turn_limit_hit": 0.0, "template_mismatch": 0.0}] * len(results)
    return results, stats



def mt_settings(response_length: int, **section):
    """The loop's settings of a `multi_turn` section with these keys (enabled) and this response budget."""
    cfg = MegappoConfig()
    cfg.actor_rollout_ref.rollout.multi_turn = MultiTurnConfig(enable=True, **section)
    cfg.data.max_response_length = response_length
    return settings.episodes(cfg)


def test_failures_are_recorded_by_kind(calls):
    results, _ = calls
    assert [r[0]["failure"] for r in results] == ["raised", "unknown_tool", "bad_call"]
    assert "ZeroDivisionError: the tool's own bug" in results[0][0]["text"]
    assert all(r[0]["error"] == 1.0 for r in results)


def test_console_warnings_once_per_tool_and_kind(calls):
    results, _ = calls
    now = [0.0]
    out = io.StringIO()
    watch = ToolWatch(0.5, 3, out=out, clock=lambda: now[0])
    watch.warn(results)
    watch.warn(results)  # the same failures again within the minute: not said again
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("megappo train: WARNING: tool 'calculator' raised an exception: the tool calculator "
                               "failed: ZeroDivisionError: the tool's own bug")
    assert lines[1].startswith("megappo train: WARNING: tool 'search' was called but no tool of that name is "
                               "configured: there is no tool named 'search'; the tools are: calculator")
    now[0] = 61.0
    watch.warn(results[:1])
    assert out.getvalue().splitlines()[2].endswith("1 more such failures since the last warning; said at most once "
                                                   "a minute)")
    quiet = io.StringIO()
    ToolWatch(0.5, 3, speak=False, out=quiet).warn(results)  # not rank 0
    assert quiet.getvalue() == ""


def test_tool_errors_that_persist_stop_the_run(calls):
    results, stats = calls
    failing = multi_turn_metrics(stats, results)
    assert failing["tool/error_fraction"] == 1.0
    assert failing["tool/failure_fraction"] == pytest.approx(2 / 3)  # the malformed call is the model's mistake
    fine = {"tool/calls_per_sample": 1.0, "tool/failure_fraction": 0.0}
    watch = ToolWatch(0.5, 3, out=io.StringIO())
    for metrics in (failing, failing, fine, failing, failing):  # a good step breaks the streak
        watch_tools(watch, metrics, results)
    with pytest.raises(RunStopped) as info:
        watch_tools(watch, failing, results)
    message = str(info.value)
    assert message.startswith("the tool itself failed on more than actor_rollout_ref.rollout.multi_turn."
                              "max_tool_failure_fraction=0.5 of the calls for 3 steps in a row "
                              "(tool/failure_fraction 0.67 in the last)")
    assert "ZeroDivisionError: the tool's own bug" in message and "max_tool_failure_steps" in message
    never = ToolWatch(None, 3, out=io.StringIO())
    for _ in range(5):
        watch_tools(never, failing, results)


def test_the_policys_own_failing_calls_never_stop_the_run():
    """Code that fails, bad arguments, malformed calls: the model's mistakes (tool/error_fraction 1), which training
    corrects; only the tool's own failures (tool/failure_fraction) count towards the stop."""
    results = [[{"name": "python", "arguments": {}, "text": "Traceback ... ZeroDivisionError", "error": 1.0,
                 "timeout": 0.0, "latency_s": 0.01, "reward": 0.0, "metrics": {"error": 1.0}, "failure": ""},
                {"name": "", "arguments": {}, "text": "Error: not valid JSON", "error": 1.0, "timeout": 0.0,
                 "latency_s": 0.0, "reward": 0.0, "metrics": {}, "failure": "bad_call"}]]
    stats = [{"turns": 2, "budget_hit": 0, "turn_limit_hit": 0, "template_mismatch": 0}]
    metrics = multi_turn_metrics(stats, results)
    assert metrics["tool/error_fraction"] == 1.0 and metrics["tool/failure_fraction"] == 0.0
    out = io.StringIO()
    watch = ToolWatch(0.5, 2, out=out)
    for _ in range(5):
        watch_tools(watch, metrics, results)
    assert out.getvalue() == ""


def test_the_trainer_warns_and_stops(calls, capsys, monkeypatch):
    """The trainer's step metrics (dynamic_sampling): the warning on stderr, RunStopped at the configured step."""
    import torch.distributed as dist

    from megappo.trainer import dynamic_sampling

    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    results, stats = calls
    cfg = load_config("cpu/tiny_tool_ppo", ["actor_rollout_ref.rollout.multi_turn.max_tool_failure_steps=2"])
    run = SimpleNamespace(cfg=cfg, tool_watch=None, failure_watch=None)
    samples = SimpleNamespace(multi_turn=True, turn_stats=stats, tool_results=results)
    assert dynamic_sampling._turn_metrics(run, samples)["tool/error_fraction"] == 1.0
    assert "WARNING: tool 'calculator' raised an exception" in capsys.readouterr().err
    with pytest.raises(RunStopped, match="for 2 steps in a row"):
        dynamic_sampling._turn_metrics(run, samples)


def test_config_keys_are_checked():
    from megappo.checks import validate
    from megappo.config import ConfigError

    mt = load_config("cpu/tiny_tool_ppo").actor_rollout_ref.rollout.multi_turn
    assert mt.max_tool_failure_fraction == 0.5 and mt.max_tool_failure_steps == 3
    for override, expected in (("max_tool_failure_fraction=1.5", "max_tool_failure_fraction: must be in [0, 1)"),
                               ("max_tool_failure_steps=0", "max_tool_failure_steps: must be >= 1")):
        with pytest.raises(ConfigError, match=expected.replace("[", r"\[").replace(")", r"\)")):
            validate(load_config("cpu/tiny_tool_ppo", [f"actor_rollout_ref.rollout.multi_turn.{override}"]),
                     check_files=False)
    validate(load_config("cpu/tiny_tool_ppo", ["actor_rollout_ref.rollout.multi_turn.max_tool_failure_fraction=null"]),
             check_files=False)
