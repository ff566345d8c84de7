"""Multi-turn tool-calling rollouts on CPU: what a tool round trip costs.

A random-weight tiny Qwen2 (the tool task's tokenizer and chat template, megappo/tasks/tool_sum.py) on the in-process
engine (`HFEngine`). Each trajectory makes `calls` calculator calls (1-4), each turn `--turn-tokens` sampled tokens;
a random model does not call tools, so the engine's sampled tokens are replaced by a scripted call of the same
length (`Forced`: the engine still generates every token, from the whole context, as it would). Printed:

- multi-turn: trajectories/s of --trajectories trajectories with `calls` calls each (calls + 1 turns), against
  single-turn generation of the same number of model tokens (one engine call, EOS ignored);
- the round trip's overhead: (multi-turn time - single-turn time - the tool's own run time) per round (all
  trajectories' calls of a round together) and per call (divided by the trajectories too), in ms. It includes the
  engine's re-entry (the in-process engine re-reads the whole context each turn: no prefix cache across calls) and
  the prefill of the tool answers' tokens;
- the loop's own cost per call (parsing, rendering the template around the answers, tokenising them, bookkeeping)
  with an engine that costs nothing (`Instant`), in ms: the target is <= 50 ms per call.
The sandbox's start-up (the Python tool) is not included: a tool's run time is the tool's.

    python tools/bench/bench_multi_turn.py [--trajectories 16 --turn-tokens 16 --hidden 256 --layers 4]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from megappo.config.schema import MegappoConfig, MultiTurnConfig
from megappo.multi_turn.calculator import CalculatorTool
from megappo.multi_turn.env import tool_rollout
from megappo.rollout.base import RolloutEngine
from megappo.rollout.hf.engine import HFEngine
from megappo.rollout.sampling import Completion, SamplingParams
from megappo.tasks import tool_sum
from megappo.trainer import settings

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "37+85+19"}}</tool_call>'


class Forced(RolloutEngine):
    """Generates with `inner` (every token sampled, EOS ignored) but answers a scripted turn of the same length: a
    call while the trajectory has made fewer than `calls`, else the final answer."""

    def __init__(self, inner, tok, calls: int, turn_tokens: int):
        self.inner, self.tok, self.calls, self.turn_tokens = inner, tok, calls, turn_tokens
        self.call_ids = tok.encode(CALL, add_special_tokens=False)
        self.answer_ids = tok.encode("141", add_special_tokens=False) + [tok.eos_token_id]
        self.response_id = tok.convert_tokens_to_ids("<tool_response>")

    def generate(self, prompts, params, *, prompt_offset=0):
        real = self.inner.generate(prompts, SamplingParams(max_new_tokens=self.turn_tokens, ignore_eos=True,
                                                           n=params.n, seed=params.seed), prompt_offset=prompt_offset)
        out = []
        for p, group in zip(prompts, real):
            made = list(p).count(self.response_id)
            ids = self.call_ids if made < self.calls else self.answer_ids
            out.append([Completion(c.prompt_index, ids, [0.0] * len(ids), "stop") for c in group])
        return out

    def load_weights(self, buckets, *, version, mode):
        return version

    def prompt_log_probs(self, token_ids):
        return [[]]


class Instant(Forced):
    def __init__(self, tok, calls: int):
        super().__init__(None, tok, calls, 0)

    def generate(self, prompts, params, *, prompt_offset=0):
        out = []
        for p in prompts:
            ids = self.call_ids if list(p).count(self.response_id) < self.calls else self.answer_ids
            out.append([Completion(0, ids, [0.0] * len(ids), "stop") for _ in range(params.n)])
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trajectories", type=int, default=16)
    ap.add_argument("--turn-tokens", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import transformers

    task = tool_sum.ToolTask()
    tmp = tempfile.mkdtemp(prefix="bench_multi_turn_")
    tok, _ = tool_sum.make_tokenizer(task, tmp)
    config = transformers.Qwen2Config(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                      hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp)
    engine = HFEngine(tmp)
    tools = {"calculator": CalculatorTool({}, tool_sum.TOOL_SCHEMA)}
    text = tok.apply_chat_template([{"role": "user", "content": "37+85+19="}], tools=[tool_sum.TOOL_SCHEMA],
                                   tokenize=False, add_generation_prompt=True)
    prompt = tok.encode(text, add_special_tokens=False)
    prompts = [prompt] * args.trajectories
    print(f"model: hidden {args.hidden}, {args.layers} layers, vocab {len(tok)}; {args.trajectories} trajectories, "
          f"{args.turn_tokens} tokens a turn; threads {torch.get_num_threads()}; load {os.getloadavg()[0]:.2f}")
    print(f"{'calls':>5} {'multi traj/s':>12} {'single traj/s':>13} {'overhead/round ms':>17} {'overhead/call ms':>16} "
          f"{'loop/call ms':>12} {'tool ms':>8}")
    for calls in (1, 2, 3, 4):
        budget = (calls + 1) * args.turn_tokens + calls * 40
        cfg = MegappoConfig()
        cfg.actor_rollout_ref.rollout.multi_turn, cfg.data.max_response_length = MultiTurnConfig(enable=True), budget
        loop = tool_rollout(settings.episodes(cfg), tok, tools)
        forced = Forced(engine, tok, calls, args.turn_tokens)
        single_params = SamplingParams(max_new_tokens=(calls + 1) * args.turn_tokens, ignore_eos=True, seed=1)
        multi, single, instant, tool_s = [], [], [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = loop.generate(forced, prompts, SamplingParams(max_new_tokens=budget, seed=1))
            multi.append(time.perf_counter() - t0)
            assert all(g[0].extra["multi_turn"]["tool_calls"] == calls for g in out)
            tool_s.append(sum(g[0].extra["multi_turn"]["tool_latency_s"] for g in out))
            t0 = time.perf_counter()
            engine.generate(prompts, single_params)
            single.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            loop.generate(Instant(tok, calls), prompts, SamplingParams(max_new_tokens=budget, seed=1))
            instant.append(time.perf_counter() - t0)
        m, s, i, t = (sorted(x)[len(x) // 2] for x in (multi, single, instant, tool_s))
        n_calls = calls * args.trajectories
        print(f"{calls:>5} {args.trajectories / m:>12.2f} {args.trajectories / s:>13.2f} "
              f"{(m - s - t) / calls * 1e3:>17.1f} {(m - s - t) / n_calls * 1e3:>16.2f} "
              f"{(i - t) / n_calls * 1e3:>12.3f} {t / n_calls * 1e3:>8.3f}")
        loop.close()


if __name__ == "__main__":
    main()
