"""The episode loop (megappo/envs/loop.py) with environments written against megappo/envs/base.py, over a scripted
engine with the tool task's tokenizer and chat template: messages from the environment are the template's tokens
(masked), rewards add up, every environment is closed (done, budget, raise, deadline), rows pick their agents, and
an episode paused by a weight sync goes on with the new weights, each token keeping its version."""
from __future__ import annotations

import threading
import time

import pytest

from megappo.config.schema import MegappoConfig, MultiTurnConfig
from megappo.envs.registry import AgentConfigError, AgentLoops, EnvironmentLoop
from megappo.envs.base import EnvStep, Environment, EpisodeRow
from megappo.envs.engine import EpisodeEngine
from megappo.envs.failures import episode_failure
from megappo.envs.loop import EpisodeRollout
from megappo.envs.metrics import multi_turn_metrics
from megappo.rollout.base import RolloutEngine
from megappo.rollout.sampling import Completion, SamplingParams
from megappo.rollout.seeds import sample_seed
from megappo.tasks import tool_sum
from megappo.trainer import settings
from megappo.trainer.experience import Samples

CLOSED: list[str] = []


class Countdown(Environment):
    """Answers "again" until the model said `target` times "go"; reward 1 per step, 10 at the end."""

    def __init__(self, target: int = 2, fail: str = ""):
        self.target, self.fail, self.seen = target, fail, 0

    def start(self, row: EpisodeRow) -> list[dict]:
        self.name = f"{row.index}/{row.sample}"
        if self.fail == "start":
            raise RuntimeError("start broke")
        return row.prompt

    def step(self, assistant: dict) -> EnvStep:
        if self.fail == "step":
            raise RuntimeError("step broke")
        if self.fail == "hang":
            time.sleep(3)
        if self.fail == "gym":  # gym's (observation, reward, terminated, truncated, info)
            return ("again", 1.0, False, False, {})
        self.seen += 1
        if self.seen >= self.target:
            return EnvStep(reward=10.0, done=True, metrics={"steps": float(self.seen)})
        return EnvStep([{"role": "user", "content": "again<|im_end|>"}], reward=1.0)

    def close(self) -> None:
        CLOSED.append(self.name)


class Scripted(RolloutEngine):
    """Answers every prompt with "go<|im_end|>" (log-prob -0.5 per token); `abort_after` tokens into its first call
    it answers with the tokens so far and finish_reason "abort" (a weight sync's abort)."""

    def __init__(self, tok, abort_after=None):
        self.tok, self.abort_after, self.requests = tok, abort_after, []

    def generate(self, prompts, params, *, prompt_offset=0):
        self.requests.append((len(prompts), params))
        out = []
        for k, p in enumerate(prompts):
            # a turn continued after an abort goes on from its tokens
            ids = self.tok.encode("o<|im_end|>" if self.tok.decode(p).endswith("g") else "go<|im_end|>",
                                  add_special_tokens=False)
            group = []
            for _ in range(params.n):
                cut, finish = ids[:params.max_new_tokens], "stop"
                if self.abort_after is not None:
                    cut, finish = cut[:self.abort_after], "abort"
                group.append(Completion(k, cut, [-0.5] * len(cut), finish, weight_version=self.weight_version))
            out.append(group)
        self.abort_after = None
        return out

    def load_weights(self, buckets, *, version, mode, partial=False):
        self.weight_version = version
        return version

    def prompt_log_probs(self, token_ids):
        return [[0.0] * (len(token_ids) - 1)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    tokenizer, _ = tool_sum.make_tokenizer(tool_sum.ToolTask(), str(tmp_path_factory.mktemp("tok")))
    return tokenizer


def episode_settings(response_length=200, **agent):
    cfg = MegappoConfig()
    cfg.actor_rollout_ref.rollout.multi_turn = MultiTurnConfig()
    cfg.actor_rollout_ref.rollout.agent.default_agent_loop = "countdown"
    for k, v in agent.items():
        setattr(cfg.actor_rollout_ref.rollout.agent, k, v)
    cfg.data.max_response_length = response_length
    return settings.episodes(cfg)


def rollout(tok, response_length=200, agents=None, **agent):
    s = episode_settings(response_length, **agent)
    agents = agents or {"countdown": {}}
    makers = {name: (lambda name=name, kw=kw: EnvironmentLoop(name, Countdown, tok, kw, s.step_timeout_s))
              for name, kw in agents.items()}
    return EpisodeRollout(s, AgentLoops(s, tok, makers, "countdown"))


def prompt(tok, text="start"):
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                              add_generation_prompt=True), add_special_tokens=False)


def rows(n=1, **kw):
    return [EpisodeRow([{"role": "user", "content": "start"}], "d", None, {}, index=k, **kw) for k in range(n)]


def test_episode_tokens_masks_rewards_and_close(tok):
    CLOSED.clear()
    loop = rollout(tok, agents={"countdown": {"target": 3}})
    engine = Scripted(tok)
    [[a, b]] = loop.generate(engine, [prompt(tok)], SamplingParams(max_new_tokens=60, n=2, seed=5), rows=rows())
    assert [k for k, _ in engine.requests] == [1, 2, 2]  # the first round is single-turn sampling's request
    assert engine.requests[0][1].seed == 5 and engine.requests[0][1].n == 2
    for c in (a, b):
        ids, mask = c.output_ids, c.extra["loss_mask"]
        assert tok.decode([t for t, m in zip(ids, mask) if m]) == "go<|im_end|>" * 3
        # the environment's text is escaped: its fake <|im_end|> is text, not the control token
        assert c.extra["messages"][1] == {"role": "user", "content": "again&lt;|im_end|>"}
        full = tok.encode(tok.apply_chat_template([{"role": "user", "content": "start"}] + c.extra["messages"],
                                                  tokenize=False), add_special_tokens=False)
        assert prompt(tok) + ids == full[:len(prompt(tok)) + len(ids)]
        assert c.extra["env_reward"] == 12.0 and c.extra["multi_turn"]["turns"] == 3
        assert c.extra["multi_turn"]["env_metrics"] == {"steps": 3.0}
        assert c.extra["multi_turn"]["template_mismatch"] == 0.0 and c.finish_reason == "stop"
        assert all(lp == (-0.5 if m else 0.0) for lp, m in zip(c.log_probs, mask))
    assert sorted(CLOSED) == ["0/0", "0/1"]
    m = multi_turn_metrics([a.extra["multi_turn"], b.extra["multi_turn"]], [[], []])
    assert m["env/reward_mean"] == 12.0 and m["env/error_fraction"] == 0.0 and m["multi_turn/turns_mean"] == 3.0
    assert m["env/steps"] == 3.0
    loop.close()


@pytest.mark.parametrize("fail", ["start", "step", "hang", "gym"])
def test_a_broken_environment_ends_its_episode_and_keeps_the_sample(tok, fail, caplog):
    CLOSED.clear()
    loop = rollout(tok, agents={"countdown": {"fail": fail}}, step_timeout_s=0.5)
    [[c]] = loop.generate(Scripted(tok), [prompt(tok)], SamplingParams(max_new_tokens=60), rows=rows())
    stats = c.extra["multi_turn"]
    assert stats["env_timeout" if fail == "hang" else "env_error"] == 1.0
    assert episode_failure(stats) == ("env_timeout" if fail == "hang" else "env_error")
    said = {"start": "environment countdown: start raised RuntimeError: start broke",
            "step": "environment countdown: step raised RuntimeError: step broke",
            "hang": "environment countdown: a step passed its 0.5s deadline (step_timeout_s)",
            "gym": "environment countdown: step returned tuple ('again', 1.0, False, False, {}), not an EnvStep"}
    assert stats["error_text"].startswith(said[fail]) and stats["agent_name"] == "countdown"
    assert ("in step" in stats["traceback"] or "in start" in stats["traceback"]) if fail in ("start", "step") \
        else stats["traceback"] is None
    assert not caplog.records  # said once by the run's failure watch, with a count: not once per episode here
    assert c.output_ids == ([] if fail == "start" else tok.encode("go<|im_end|>", add_special_tokens=False))
    assert CLOSED == (["0/0"] if fail != "start" else ["0/0"])  # closed even when start raised
    loop.close()


def test_budget_ends_an_episode_and_closes_it(tok):
    CLOSED.clear()
    loop = rollout(tok, response_length=12, agents={"countdown": {"target": 5}})
    [[c]] = loop.generate(Scripted(tok), [prompt(tok)], SamplingParams(max_new_tokens=12), rows=rows())
    assert c.extra["multi_turn"]["budget_hit"] == 1.0 and len(c.output_ids) <= 12 and CLOSED == ["0/0"]
    loop.close()


def test_rows_pick_their_agent(tok):
    CLOSED.clear()
    loop = rollout(tok, agents={"countdown": {"target": 1}, "long": {"target": 2}})
    picked = [EpisodeRow([{"role": "user", "content": "start"}], "d", None, {}, 0, agent_name="long"),
              EpisodeRow([{"role": "user", "content": "start"}], "d", None, {}, 1)]
    [[a], [b]] = loop.generate(Scripted(tok), [prompt(tok)] * 2, SamplingParams(max_new_tokens=60), rows=picked)
    assert (a.extra["agent"], a.extra["multi_turn"]["turns"]) == ("long", 2)
    assert (b.extra["agent"], b.extra["multi_turn"]["turns"]) == ("countdown", 1)
    with pytest.raises(AgentConfigError, match="did you mean 'long'"):
        loop.generate(Scripted(tok), [prompt(tok)], SamplingParams(max_new_tokens=60),
                      rows=[EpisodeRow([], "d", None, {}, 0, agent_name="lonng")])
    loop.close()


class OwnPrompt(Countdown):
    def start(self, row):
        super().start(row)
        return [{"role": "system", "content": "count"}, {"role": "user", "content": "start"}]


def test_an_environment_with_its_own_first_messages_samples_with_the_single_turn_seeds(tok):
    s = episode_settings()
    loop = EpisodeRollout(s, AgentLoops(s, tok, {"own": lambda: EnvironmentLoop("own", OwnPrompt, tok, {"target": 1})},
                                        "own"))
    engine = Scripted(tok)
    [[a, b]] = loop.generate(engine, [prompt(tok)], SamplingParams(max_new_tokens=60, n=2, seed=9), prompt_offset=4,
                             rows=rows())
    want = tok.encode(tok.apply_chat_template([{"role": "system", "content": "count"},
                                               {"role": "user", "content": "start"}], tokenize=False,
                                              add_generation_prompt=True), add_special_tokens=False)
    assert a.extra["prompt_ids"] == want == b.extra["prompt_ids"]
    params = engine.requests[0][1]
    assert params.n == 1 and params.row_seeds == (sample_seed(9, 4, 0, 2), sample_seed(9, 4, 1, 2))
    loop.close()


def test_an_episode_paused_by_a_sync_goes_on_with_the_new_weights(tok):
    """The round is aborted 1 token into the first turn (version 0); the engine gets version 1; the continued
    episode finishes its turn and the next ones with it: per-token versions, one sample each, masks intact."""
    CLOSED.clear()
    loop = rollout(tok, agents={"countdown": {"target": 2}})
    inner = Scripted(tok, abort_after=1)
    engine = EpisodeEngine(inner, loop)
    params = SamplingParams(max_new_tokens=60, n=2, seed=1)
    done = engine.generate([prompt(tok)], params, rows=rows())
    assert [c.finish_reason for c in done[0]] == ["abort", "abort"] and CLOSED == []
    inner.load_weights([], version=1, mode="tensor")
    [[a, b]] = engine.continue_generation([prompt(tok)], done, params, round_=1, rows=rows())
    go = tok.encode("go<|im_end|>", add_special_tokens=False)
    for c in (a, b):
        assert c.finish_reason == "stop" and c.extra["partial"] and c.extra["env_reward"] == 11.0
        assert tok.decode([t for t, m in zip(c.output_ids, c.extra["loss_mask"]) if m]) == "go<|im_end|>" * 2
        model = [v for v, m in zip(c.token_versions, c.extra["loss_mask"]) if m]
        assert model == [0] + [1] * (2 * len(go) - 1) and c.weight_version == 0
        assert c.extra["messages"][0] == {"role": "assistant", "content": "go"}  # the turn is whole across the sync
    assert sorted(CLOSED) == ["0/0", "0/1"] and loop.paused == {}
    from megappo.data.dataset import PromptBatch
    import torch

    ids = torch.tensor([prompt(tok)])
    batch = PromptBatch(ids, torch.ones_like(ids), torch.zeros_like(ids), [[]], ["d"], [None], [{}], [""],
                        torch.tensor([0]))
    samples = Samples.from_completions(batch, [[a, b]])
    assert samples.partial == [True, True] and samples.token_versions[0] == a.token_versions
    behind = samples.token_staleness(1)
    assert behind.count(1) == 2 and set(behind) == {0, 1}  # one stale token per sample: the first
    engine.close()


def test_gsm8k_feedback_environment():
    """The GPU recipe's environment: a wrong answer is told to try again, a right one ends it with reward 1, the
    turn limit ends it (truncated) without reward; per-row max_turns from extra_info."""
    from megappo.envs.gsm8k_feedback import RETRY, Gsm8kFeedback

    env = Gsm8kFeedback()
    row = EpisodeRow([{"role": "user", "content": "q"}], "openai/gsm8k", "72", {"max_turns": 2}, 0)
    assert env.start(row) is row.prompt
    wrong = env.step({"role": "assistant", "content": "#### 71"})
    assert wrong.messages == [{"role": "user", "content": RETRY}] and not wrong.done and wrong.reward == 0
    right = env.step({"role": "assistant", "content": "so #### 72"})
    assert right.done and right.reward == 1.0 and right.metrics == {"solved_at_turn": 2.0}
    env = Gsm8kFeedback()
    env.start(row)
    env.step({"role": "assistant", "content": "#### 1"})
    last = env.step({"role": "assistant", "content": "#### 2"})
    assert last.done and last.truncated and last.reward == 0.0


def test_a_rows_tools_kwargs_reach_the_tools_create(tok):
    """verl's per-row `extra_info.tools_kwargs[tool].create_kwargs` is given to that tool's `create`, per episode."""
    from megappo.multi_turn.env import tool_rollout
    from megappo.multi_turn.calculator import CalculatorTool

    created: list = []

    class Seeded(CalculatorTool):
        def create(self, instance_id, **kwargs):
            created.append(kwargs)

    cfg = MegappoConfig()
    cfg.actor_rollout_ref.rollout.multi_turn = MultiTurnConfig(enable=True, tool_config_path="unused.yaml")
    cfg.data.max_response_length = 120
    loop = tool_rollout(settings.episodes(cfg), tok, {"calculator": Seeded({}, tool_sum.TOOL_SCHEMA)})
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'

    class Calls(Scripted):
        def generate(self, prompts, params, *, prompt_offset=0):
            return [[Completion(k, self.tok.encode(call if "tool_response" not in self.tok.decode(p) else "2<|im_end|>",
                                                   add_special_tokens=False), [0.0] * 30, "stop")
                     for _ in range(params.n)] for k, p in enumerate(prompts)]

    kwargs = {"calculator": {"create_kwargs": {"ground_truth": "2"}}}
    row = EpisodeRow([{"role": "user", "content": "1+1="}], "d", "2", {"tools_kwargs": kwargs}, 0)
    p = tok.encode(tok.apply_chat_template([{"role": "user", "content": "1+1="}], tools=[tool_sum.TOOL_SCHEMA],
                                           tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    [[c]] = loop.generate(Calls(tok), [p], SamplingParams(max_new_tokens=120), rows=[row])
    assert created == [{"ground_truth": "2"}] and c.extra["tool_results"][0]["text"] == "2"
    loop.close()


def one_call(base_url, api_key, row):
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = client.chat.completions.create(model="policy", messages=list(row.prompt), max_tokens=8)
    return {"reward": 2.0 if reply.choices[0].message.content == "go" else -1.0, "metrics": {"said_go": 1.0}}


def test_one_request_mixes_an_agent_program_and_an_environment(tok):
    """Rows name their agents: an agent program (through the real endpoint and openai client) and an environment
    in the same request; each sample comes back once, in order, shaped alike (stats, mask, versions, reward)."""
    from megappo.agents.program import AgentProgramLoop

    s = episode_settings()
    makers = {"countdown": lambda: EnvironmentLoop("countdown", Countdown, tok, {"target": 1}),
              "prog": lambda: AgentProgramLoop("prog", one_call, tok, s)}
    loop = EpisodeRollout(s, AgentLoops(s, tok, makers, "countdown"))
    mixed = [EpisodeRow([{"role": "user", "content": "start"}], "d", None, {}, 0, agent_name="prog"),
             EpisodeRow([{"role": "user", "content": "start"}], "d", None, {}, 1)]
    try:
        [[a], [b]] = loop.generate(Scripted(tok), [prompt(tok)] * 2, SamplingParams(max_new_tokens=60, seed=4),
                                   rows=mixed)
    finally:
        loop.close()
    assert (a.extra["agent"], a.extra["env_reward"], a.finish_reason) == ("prog", 2.0, "stop")
    assert a.extra["prompt_ids"] == prompt(tok) and tok.decode(a.output_ids) == "go<|im_end|>"
    assert a.extra["loss_mask"] == [1] * len(a.output_ids) and a.token_versions == [0] * len(a.output_ids)
    assert a.extra["multi_turn"]["agent"]["calls"] == 1 and a.extra["multi_turn"]["env_metrics"] == {"said_go": 1.0}
    assert (b.extra["agent"], b.extra["env_reward"]) == ("countdown", 10.0)
    m = multi_turn_metrics([a.extra["multi_turn"], b.extra["multi_turn"]], [[], []])
    assert m["agent/calls_per_episode"] == 1.0 and m["agent/retokenized_fraction"] == 0.0
    assert m["env/reward_mean"] == 6.0
