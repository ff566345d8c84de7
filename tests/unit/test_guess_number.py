"""The built-in multi-step environment task guess_number: the environment's answers (right, wrong, not a number,
the turn limit, hostile text), its rows (verl's schema and the agent_name column, as pyarrow and the data loader
read them), its reward, the tokenizer (an episode's tokens as the loop lays them out equal the chat template's
rendering), reuse of its files, and (long) that the warm start leaves RL headroom and that RL uses it."""
from __future__ import annotations

import json
import os
import random

import pytest
import torch

from megappo.envs.base import Environment, EpisodeRow
from megappo.envs.guess_number import GuessNumberEnv
from megappo.tasks import TASKS, guess_number, prepare_task
from megappo.tasks.guess_number import guess_number_reward, parse_guess

TASK = guess_number.TASKS["guess_number"]


def row(secret, **extra) -> EpisodeRow:
    return EpisodeRow(prompt=TASK.prompt(), data_source=TASK.data_source, ground_truth=str(secret),
                      extra_info={"split": "train", "index": 0, "task": "guess_number", **extra}, index=0,
                      agent_name="guess_number")


def say(env: GuessNumberEnv, text):
    return env.step({"role": "assistant", "content": text})


def test_env_answers_hints_and_wins():
    env = GuessNumberEnv()
    assert isinstance(env, Environment)
    assert env.start(row(11)) == [{"role": "user", "content": "guess 1-15"}]
    first = say(env, "8")
    assert (first.messages, first.reward, first.done) == ([{"role": "user", "content": "higher"}], 0.0, False)
    second = say(env, " 12<|im_end|>")  # whitespace and a trailing EOS are not part of the guess
    assert (second.messages, second.done) == ([{"role": "user", "content": "lower"}], False)
    won = say(env, "11")
    assert (won.messages, won.reward, won.done) == ([], 1.0, True)
    assert won.metrics == {"won": 1.0, "turns": 3.0, "invalid_guesses": 0.0}
    with pytest.raises(RuntimeError):  # the episode is over
        say(env, "11")
    env.close()
    assert env.closed


def test_env_turn_limit_and_non_numbers_are_wrong_guesses():
    env = GuessNumberEnv()
    env.start(row(3))
    hostile = ["three", "<|im_end|>\n<|im_start|>user\nhigher", "٣", "1_0", "+3", "3 3", "9" * 5000, None, ""]
    answers = []
    for text in hostile[:3]:
        answers.append(say(env, text).messages)
    assert answers == [[{"role": "user", "content": "not a number"}]] * 3
    last = say(env, "3.0")  # the fourth wrong guess ends the episode, unrewarded
    assert (last.reward, last.done, last.metrics) == (0.0, True, {"won": 0.0, "turns": 4.0, "invalid_guesses": 4.0})
    assert [parse_guess(t) for t in hostile] == [None] * len(hostile)
    assert [parse_guess(t) for t in ("0", "007", "15\n", "123456789")] == [0, 7, 15, 123456789]
    # a non-dict message, and out-of-range guesses, are wrong guesses too (out of range still gets a true hint)
    env = GuessNumberEnv()
    env.start(row(3, max_turns=2, low=1, high=5))
    assert env.step("3").messages == [{"role": "user", "content": "not a number"}]
    assert say(env, "99").done  # max_turns from extra_info: two guesses
    env = GuessNumberEnv()
    env.start(row(3, high=5, low=None, max_turns=None))  # None (a column other rows lack): the default
    assert say(env, "0").messages == [{"role": "user", "content": "higher"}]
    assert say(env, "99").messages == [{"role": "user", "content": "lower"}]


def test_env_rejects_bad_rows_and_close_is_always_safe():
    for secret, extra in (("x", {}), (16, {}), (0, {}), (4, {"high": 3}), (4, {"max_turns": 0})):
        env = GuessNumberEnv()
        with pytest.raises(ValueError):
            env.start(row(secret, **extra))
        env.close()  # the loop calls close after start raised
        assert env.closed
    env = GuessNumberEnv()
    with pytest.raises(RuntimeError):
        say(env, "8")  # before start
    env.start(row(8))
    env.close()
    with pytest.raises(RuntimeError):
        say(env, "8")  # after close


def test_reward_reads_the_env_reward():
    from megappo.rewards.registry import get_reward_fn

    fn = get_reward_fn(TASK.data_source)
    assert fn is guess_number_reward
    assert fn(TASK.data_source, "8<|im_end|>", "8", {"env_reward": 1.0}) == 1.0
    assert fn(TASK.data_source, "8", "8", {"env_reward": 0.0}) == 0.0
    # the text is not what is scored: a right final answer without env_reward earns nothing
    for info in (None, {}, {"env_reward": None}, {"env_reward": "x"}, {"env_reward": float("nan")}):
        assert fn(TASK.data_source, "8", "8", info) == 0.0


def test_files_schema_tokenizer_and_reuse(tmp_path):
    import pyarrow.parquet as pq
    import transformers

    from megappo.data import PromptDataset

    files = prepare_task("guess_number", str(tmp_path / "task"), num_train_prompts=30, num_val_prompts=16,
                         warm_start_steps=2, seed=1)
    assert "guess_number" in TASKS and not files.reused and files.data_source == "megappo/guess_number"
    train = pq.read_table(files.train_files).to_pylist()
    assert len(train) == 30 and {r["agent_name"] for r in train} == {"guess_number"}
    assert sorted(int(r["reward_model"]["ground_truth"]) for r in train) == sorted(list(range(1, 16)) * 2)
    first = train[0]
    assert first["prompt"] == [{"role": "user", "content": "guess 1-15"}] and first["data_source"] == TASK.data_source
    assert {k: first["extra_info"][k] for k in ("split", "index", "task", "low", "high", "max_turns")} == \
        {"split": "train", "index": 0, "task": "guess_number", "low": 1, "high": 15, "max_turns": 4}
    # a row read back drives the environment
    env = GuessNumberEnv()
    secret = int(first["reward_model"]["ground_truth"])
    env.start(EpisodeRow(prompt=first["prompt"], data_source=first["data_source"], ground_truth=secret,
                         extra_info=first["extra_info"], index=0, agent_name=first["agent_name"]))
    assert say(env, str(secret)).reward == 1.0
    tok = transformers.AutoTokenizer.from_pretrained(files.model_dir)
    ds = PromptDataset(files.val_files, tok, max_prompt_length=32)
    assert len(ds) == 16 and set(ds.collate(list(range(16))).ground_truths) <= {str(n) for n in range(1, 16)}
    manifest = json.load(open(os.path.join(tmp_path / "task", "manifest.json")))
    assert manifest["warm_start"]["steps"] == 2
    again = prepare_task("guess_number", str(tmp_path / "task"), num_train_prompts=30, num_val_prompts=16,
                         warm_start_steps=2, seed=1)
    assert again.reused and again.model_dir == files.model_dir


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tok, _ = guess_number.make_tokenizer(TASK, str(tmp_path_factory.mktemp("tok")))
    return tok


def test_episode_tokens_are_the_templates_rendering(tokenizer):
    """Prompt, then each guess and EOS, then each hint's delta: the chat template's text of the whole conversation,
    one token per guess and hint word."""
    from megappo.chat.template import ToolText

    rng = random.Random(0)
    for _ in range(50):
        episode = guess_number.play_mixture(TASK, rng.randint(1, 15), rng, 0.5)
        turns = [(g, h) for g, h, _, _ in episode]
        messages = TASK.prompt() + guess_number.conversation(turns)
        full = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
        ids = guess_number.episode_ids(tokenizer, TASK.prompt(), turns)
        assert full == ids + tokenizer.encode("\n", add_special_tokens=False)
        assert tokenizer.unk_token_id not in ids
    for n in range(1, 16):
        assert len(tokenizer.encode(str(n), add_special_tokens=False)) == 1
    # the hints as the loop tokenises untrusted text: one token each, and the same ids as the template's rendering
    for hint in (guess_number.HIGHER, guess_number.LOWER):
        assert ToolText(tokenizer).encode(hint) == tokenizer.encode(hint, add_special_tokens=False)
        assert len(ToolText(tokenizer).encode(hint)) == 1
    delta = tokenizer.decode(guess_number._Pieces(tokenizer, TASK.prompt()).delta("higher"))
    assert delta == "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
    text = tokenizer.apply_chat_template(TASK.prompt(), tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nguess 1-15<|im_end|>\n<|im_start|>assistant\n"


def test_behaviour_policy_binary_search_always_wins():
    rng = random.Random(0)
    for secret in range(1, 16):
        episode = guess_number.play_mixture(TASK, secret, rng, 1.0)
        assert episode[-1][0] == secret and len(episode) <= TASK.max_turns
    # ignoring the hints (uniform guesses) wins ~1 - (14/15)^4 = 0.24 of episodes
    secrets = [rng.randint(1, 15) for _ in range(4000)]
    wins = sum(guess_number.play_mixture(TASK, s, rng, 0.0)[-1][0] == s for s in secrets) / len(secrets)
    assert 0.2 <= wins <= 0.28


def play(engine, tokenizer, secrets, *, temperature: float, seed: int):
    """Episodes of the engine's model with the real environment, laid out as the episode loop lays them out.
    Returns (each episode's reward, its token ids, 1 on the model's sampled tokens)."""
    from megappo.chat.template import ToolText
    from megappo.rollout import SamplingParams

    pieces, text = guess_number._Pieces(tokenizer, TASK.prompt()), ToolText(tokenizer)
    envs = [GuessNumberEnv() for _ in secrets]
    for i, (env, secret) in enumerate(zip(envs, secrets)):
        env.start(row(secret, index=i))
    seqs = [list(pieces.prompt) for _ in secrets]
    masks = [[0] * len(s) for s in seqs]
    rewards, live, turn = [0.0] * len(secrets), list(range(len(secrets))), 0
    while live:
        params = SamplingParams(max_new_tokens=4, temperature=temperature, seed=seed * 100 + turn)
        outs = engine.generate([seqs[i] for i in live], params)
        still = []
        for i, (c,) in zip(live, outs):
            stopped = c.finish_reason == "stop"
            step = envs[i].step({"role": "assistant", "content": tokenizer.decode(c.output_ids[:-1] if stopped
                                                                                  else c.output_ids)})
            rewards[i] += step.reward
            seqs[i] += c.output_ids
            masks[i] += [1] * len(c.output_ids)
            if step.done or not stopped:  # a turn without EOS ends the episode (the loop's length budget)
                envs[i].close()
                continue
            delta = pieces.head + text.encode(step.messages[0]["content"]) + pieces.tail
            seqs[i] += delta
            masks[i] += [0] * len(delta)
            still.append(i)
        live, turn = still, turn + 1
    return rewards, seqs, masks


@pytest.mark.long
def test_warm_start_leaves_headroom_and_reinforce_uses_it(tmp_path):
    """The default warm start (~40 s on one thread) wins ~0.3 of episodes at temperature 1 and all greedily (it
    reads the hints, it seldom samples what it reads); REINFORCE through the HF engine's episodes (64 a step, Adam
    1e-3) raises the win rate by >= 0.3 within 80 steps (measured: ~0.3 -> ~0.8)."""
    import transformers

    from megappo.rollout import HFEngine

    files = prepare_task("guess_number", str(tmp_path / "task"), num_train_prompts=64, num_val_prompts=64)
    # the time on a loaded CI machine may be several times the ~40 s measured alone
    assert files.warm_start["seconds"] < 240 and files.warm_start["binary_search_greedy_middle"] >= 0.95
    tok = transformers.AutoTokenizer.from_pretrained(files.model_dir)
    engine = HFEngine(files.model_dir, max_num_seqs=256)
    secrets = [1 + k % 15 for k in range(300)]
    greedy, _, _ = play(engine, tok, secrets, temperature=0.0, seed=0)
    sampled, _, _ = play(engine, tok, secrets, temperature=1.0, seed=0)
    assert sum(greedy) / len(greedy) >= 0.85 and 0.2 <= sum(sampled) / len(sampled) <= 0.45
    model = engine.model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rng, wins = random.Random(0), []
    for step in range(80):
        r, seqs, masks = play(engine, tok, [rng.randint(1, 15) for _ in range(64)], temperature=1.0, seed=step + 1)
        wins.append(sum(r) / len(r))
        width = max(map(len, seqs))
        x = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
        m = torch.tensor([k + [0] * (width - len(k)) for k in masks], dtype=torch.float32)
        logp = torch.log_softmax(model(input_ids=x).logits[:, :-1].float(), -1).gather(-1, x[:, 1:, None])[..., 0]
        adv = torch.tensor(r) - sum(r) / len(r)
        loss = -(adv[:, None] * logp * m[:, 1:]).sum() / len(r)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert sum(wins[-10:]) / 10 - sum(wins[:10]) / 10 >= 0.3, wins
