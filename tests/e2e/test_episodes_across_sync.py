"""Episodes continued across a weight sync on the real in-process engine (async_training.partial_rollout): the
producer's pause aborts a request of multi-turn episodes mid-way; the engine takes new weights; the episodes go on
from their tokens. Every token's log-prob is the one of the weights its version names (the old model's before the
sync, the new model's after), so rollout correction compares each token with the policy that sampled it; the
environment's tokens stay masked; every sample comes back once."""
from __future__ import annotations

import time

import pytest
import torch

from megappo.config.schema import MegappoConfig
from megappo.envs.registry import AgentLoops
from megappo.envs.base import EnvStep, Environment, EpisodeRow
from megappo.envs.engine import EpisodeEngine
from megappo.envs.loop import EpisodeRollout
from megappo.chat.template import ChatDelta
from megappo.rollout import HFEngine, SamplingParams
from megappo.tasks import tool_sum
from megappo.trainer import settings
from megappo.trainer.async_rollout import Producer, _Job

pytestmark = pytest.mark.e2e


class Again(Environment):
    def __init__(self):
        self.steps = 0

    def start(self, row):
        return row.prompt

    def step(self, assistant):
        self.steps += 1
        return EnvStep(reward=1.0, done=True) if self.steps == 3 else EnvStep([{"role": "user", "content": "more"}])


class ShortTurns:
    """An agent whose turns end at any of half the vocabulary (a random model's turns are then a few tokens)."""

    name, own_turn_limits, drives_episodes, step_timeout_s = "again", False, False, 10.0

    def __init__(self, tok):
        self.delta = ChatDelta(tok, [])
        self.stop_ids = tuple(range(3, len(tok), 2))

    def make(self, row):
        return Again()

    def close(self):
        pass


def test_episodes_paused_by_a_sync_continue_under_the_new_weights(tmp_path):
    import transformers

    torch.set_num_threads(1)
    torch.manual_seed(0)
    tok, config = tool_sum.make_tokenizer(tool_sum.ToolTask(), str(tmp_path / "m"))
    transformers.Qwen2ForCausalLM(config).save_pretrained(str(tmp_path / "m"))
    cfg = MegappoConfig()
    cfg.actor_rollout_ref.rollout.agent.default_agent_loop = "again"
    cfg.data.max_response_length = 120
    s = settings.episodes(cfg)
    engine = HFEngine(str(tmp_path / "m"), seed=0)
    old = {k: v.clone() for k, v in engine.model.state_dict().items()}
    loop = EpisodeRollout(s, AgentLoops(s, tok, {"again": lambda: ShortTurns(tok)}, "again"))
    episodes = EpisodeEngine(engine, loop)
    producer = Producer(episodes, partial=True)
    forwards: list = []

    def sync_arrives(*_):  # a few forwards in (the first round's decode), a sync pauses the producer
        forwards.append(1)
        if len(forwards) == 3:
            with producer.cv:
                producer.paused = True
            episodes.abort()

    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "12+34+56="}], tokenize=False,
                                                add_generation_prompt=True), add_special_tokens=False)
    rows = [EpisodeRow([{"role": "user", "content": "12+34+56="}], "d", None, {}, k) for k in range(2)]
    hook = engine.model.register_forward_hook(sync_arrives)
    try:
        job = _Job([prompt, prompt], SamplingParams(max_new_tokens=120, n=2, seed=3), 0, request={"rows": rows})
        future = producer.put(job)
        deadline = time.monotonic() + 120
        while job.done is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert job.done is not None and not future.done()
        assert any(c.finish_reason == "abort" for g in job.done for c in g)  # live episodes wait, ended ones are done
        hook.remove()
        new = [(k, v * 1.5) for k, v in old.items()]  # the sync: other weights, version 1
        engine.load_weights(new, version=1, mode="tensor")
        producer.resume()
        groups = future.result(timeout=120)
    finally:
        hook.remove()
        producer.close()
        episodes.close()
    assert [len(g) for g in groups] == [2, 2]
    model = transformers.Qwen2ForCausalLM(config).eval()
    for group in groups:
        for c in group:
            assert c.finish_reason == "stop" and c.extra["env_reward"] == 1.0 and c.extra["partial"]
            mask, versions = c.extra["loss_mask"], c.token_versions
            assert set(v for v, m in zip(versions, mask) if m) == {0, 1} and c.weight_version == 0
            first_new = versions.index(1)
            assert all(v == 0 for v in versions[:first_new]) and all(v == 1 for v in versions[first_new:])
            ids = torch.tensor([prompt + c.output_ids])
            for version, weights in ((0, old), (1, dict(new))):
                model.load_state_dict(weights)
                with torch.no_grad():
                    logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1].float(), -1)
                want = logp.gather(-1, torch.tensor(c.output_ids)[:, None])[:, 0]
                for k, (v, m) in enumerate(zip(versions, mask)):
                    if m and v == version:
                        assert abs(c.log_probs[k] - float(want[k])) < 1e-3, (version, k)
                    if not m:
                        assert c.log_probs[k] == 0.0
