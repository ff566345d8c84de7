"""megappo.tasks: the built-in synthetic task (tiny warm-started model, tokenizer, prompts) and its rule reward."""
import hashlib
import json
import os
import subprocess
import sys
import threading

import pyarrow.parquet as pq
import pytest
import torch

from megappo.rewards import RewardScorer, ScoreItem, default_compute_score, get_reward_fn, registered_data_sources
from megappo.tasks import TASKS, TaskFiles, prepare_task, read_task_files, synthetic_reward

NAME = "digit_max"
SMALL = dict(num_train_prompts=48, num_val_prompts=12, warm_start_steps=3, seed=0)


def _sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _rows(path: str) -> list[dict]:
    return pq.read_table(path).to_pylist()


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> TaskFiles:
    return prepare_task(NAME, str(tmp_path_factory.mktemp("task") / NAME), **SMALL)


def test_files_and_layout(small):
    task = TASKS[NAME]
    assert small.data_source == task.data_source == "megappo/digit_max" and small.task == NAME and not small.reused
    for path in (small.train_files, small.val_files, os.path.join(small.model_dir, "model.safetensors"),
                 os.path.join(small.model_dir, "tokenizer.json")):
        assert os.path.isfile(path), path
    out_dir = os.path.dirname(small.model_dir)
    assert not [e for e in os.listdir(out_dir) if e.startswith(".tmp-")]  # no build leftovers
    manifest = json.load(open(os.path.join(out_dir, "manifest.json")))
    assert manifest["params"]["warm_start_steps"] == 3 and manifest["params"]["spec"]["smoothing"] == task.smoothing
    assert set(small.warm_start) >= {"val_expected_reward_t1", "val_greedy_accuracy", "seconds"}
    assert read_task_files(out_dir) == TaskFiles(**{**small.__dict__, "reused": True})

    train, val = _rows(small.train_files), _rows(small.val_files)
    assert len(train) == 48 and len(val) == 12
    for row in train + val:
        (msg,) = row["prompt"]
        words = msg["content"].split()
        assert msg["role"] == "user" and words[0] == "max" and words[-1] == "=" and len(words) == 6
        assert row["reward_model"] == {"style": "rule", "ground_truth": str(max(map(int, words[1:5])))}
        assert row["data_source"] == "megappo/digit_max" and row["reward_model"]["ground_truth"] != "0"
    val_prompts = {r["prompt"][0]["content"] for r in val}
    assert len(val_prompts) == 12  # distinct
    assert not val_prompts & {r["prompt"][0]["content"] for r in train}  # held out


def test_deterministic_in_seed(small, tmp_path):
    again = prepare_task(NAME, str(tmp_path / "again"), **SMALL)
    other = prepare_task(NAME, str(tmp_path / "other"), **{**SMALL, "seed": 1})
    weights = lambda files: _sha(os.path.join(files.model_dir, "model.safetensors"))  # noqa: E731
    assert weights(again) == weights(small)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        assert _sha(os.path.join(again.model_dir, name)) == _sha(os.path.join(small.model_dir, name)), name
    assert _rows(again.train_files) == _rows(small.train_files)
    assert _rows(again.val_files) == _rows(small.val_files)
    assert again.warm_start["val_expected_reward_t1"] == small.warm_start["val_expected_reward_t1"]
    assert weights(other) != weights(small)
    assert _rows(other.train_files) != _rows(small.train_files)


def test_reuses_existing_output_and_rebuilds_on_other_parameters(tmp_path):
    out = str(tmp_path / NAME)
    first = prepare_task(NAME, out, **SMALL)
    weights = os.path.join(first.model_dir, "model.safetensors")
    stamp = os.stat(weights).st_mtime_ns, os.stat(first.train_files).st_mtime_ns
    second = prepare_task(NAME, out, **SMALL)
    assert second.reused and second.model_dir == first.model_dir
    assert (os.stat(weights).st_mtime_ns, os.stat(first.train_files).st_mtime_ns) == stamp  # nothing rewritten

    changed = prepare_task(NAME, out, **{**SMALL, "num_train_prompts": 20})
    assert not changed.reused and len(_rows(changed.train_files)) == 20

    os.remove(os.path.join(out, "model", "model.safetensors"))  # a damaged output is rebuilt, not reused
    assert not prepare_task(NAME, out, **{**SMALL, "num_train_prompts": 20}).reused


def test_concurrent_callers_build_once(tmp_path):
    out, results, errors = str(tmp_path / NAME), [], []

    def call():
        try:
            results.append(prepare_task(NAME, out, **SMALL))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(r.reused for r in results) == [False, True, True]


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown synthetic task 'nope'.*digit_max"):
        prepare_task("nope", str(tmp_path))
    with pytest.raises(ValueError, match="num_val_prompts"):
        prepare_task(NAME, str(tmp_path), num_val_prompts=5000)
    with pytest.raises(ValueError, match="warm_start_steps"):
        prepare_task(NAME, str(tmp_path), warm_start_steps=-1)


def test_reward_is_exact_match():
    assert "megappo/digit_max" in registered_data_sources()
    assert get_reward_fn("megappo/digit_max") is synthetic_reward
    score = lambda text, gt="7": default_compute_score("megappo/digit_max", text, gt, {})  # noqa: E731
    assert score("7") == 1.0
    assert score(" 7 ") == 1.0
    assert score("7<|im_end|>") == 1.0  # decoded without skip_special_tokens
    assert score("7<|im_end|><|endoftext|><|endoftext|>") == 1.0
    for wrong in ("", "6", "77", "7 7", "7 =", "max 7", "7<|im_end|>7"):
        assert score(wrong) == 0.0, wrong


def test_reward_found_in_worker_processes():
    # The scorer's workers are spawned processes that find the function by data_source.
    items = [ScoreItem("megappo/digit_max", text, "9", {}) for text in ("9", "8", "9")]
    with RewardScorer(num_workers=1, backend="process") as scorer:
        result = scorer.score(items)
    assert result.scores.tolist() == [1.0, 0.0, 1.0] and result.num_failed == 0


def test_reward_modules_do_not_import_torch():
    code = ("import sys, megappo.rewards, megappo.tasks; "
            "assert 'torch' not in sys.modules and 'pyarrow' not in sys.modules, 'heavy import'; "
            "print(megappo.rewards.get_reward_fn('megappo/digit_max').__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "synthetic_reward", out.stderr


def test_dataset_and_model_load(small):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megappo.data import PromptDataset

    tok = AutoTokenizer.from_pretrained(small.model_dir)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and not tok.chat_template
    ds = PromptDataset(small.train_files, tok, max_prompt_length=16)
    assert len(ds) == 48 and not ds.uses_chat_template
    batch = ds.collate(list(range(4)))
    assert batch.input_ids.shape == (4, 10)  # max, then " d" four times as two tokens each, then " ="
    assert batch.data_sources == ["megappo/digit_max"] * 4
    assert tok.decode(batch.input_ids[0]) == batch.raw_prompts[0][0]["content"]
    assert batch.ground_truths[0] == str(max(int(w) for w in batch.raw_prompts[0][0]["content"].split()[1:5]))

    model = AutoModelForCausalLM.from_pretrained(small.model_dir)
    cfg = model.config
    assert cfg.model_type == "qwen2" and cfg.vocab_size == len(tok)
    assert cfg.num_attention_heads % 2 == 0 and cfg.num_key_value_heads % 2 == 0 and cfg.num_hidden_layers % 2 == 0
    assert cfg.eos_token_id == tok.eos_token_id == model.generation_config.eos_token_id
    assert model.generation_config.pad_token_id == tok.pad_token_id
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids).logits
    assert logits.shape == (4, 10, len(tok)) and torch.isfinite(logits).all()


def test_default_warm_start_knows_the_rule_but_samples_it_rarely(tmp_path):
    # The main CPU job's parameters: RL needs a policy that ranks the right answer first but samples it only
    # ~23% of the time at temperature 1.
    files = prepare_task(NAME, str(tmp_path / NAME), num_val_prompts=64, seed=0)
    assert files.warm_start["steps"] == 200
    assert files.warm_start["val_greedy_accuracy"] >= 0.95
    assert 0.15 <= files.warm_start["val_expected_reward_t1"] <= 0.35
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(files.model_dir)
    model = AutoModelForCausalLM.from_pretrained(files.model_dir)
    rows = _rows(files.val_files)[:16]
    ids = torch.tensor(tok([r["prompt"][0]["content"] for r in rows])["input_ids"])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=4)
    texts = tok.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
    assert [synthetic_reward(r["data_source"], t, r["reward_model"]["ground_truth"]) for r, t in zip(rows, texts)] \
        == [1.0] * 16
    assert (out[:, ids.shape[1] + 1] == tok.eos_token_id).all()  # one digit, then EOS


def test_the_warm_start_says_what_it_does_while_it_runs(tmp_path, capsys):
    """A build says what it builds and how many warm-start steps before it starts, and how long it took and what
    the warm start reached when done (on the console: a minute of silence reads as a hung trainer); a reuse says
    nothing. The teacher of on-policy distillation's recipe says it too."""
    from megappo.tasks.teacher import prepare_teacher

    out = str(tmp_path / NAME)
    prepare_task(NAME, out, **SMALL)
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("megappo:")]  # not transformers'
    assert len(err) == 2, err
    assert err[0] == (f"megappo: building the built-in digit_max in {out}: a tiny model and its supervised warm start "
                      "of 3 steps, before the first RL step (once: a run with the same settings reuses it)")
    assert err[1].startswith("megappo: the built-in digit_max built in ") and " s (warm start: " in err[1]
    assert "val_greedy_accuracy=" in err[1] and "seconds" not in err[1]
    prepare_task(NAME, out, **SMALL)
    assert "megappo:" not in capsys.readouterr().err
    prepare_teacher(NAME, str(tmp_path / "teacher"), smoothing=0.05, warm_start_steps=2, num_val_prompts=12)
    err = capsys.readouterr().err
    assert "megappo: building the built-in teacher of digit_max in " in err and "warm start of 2 steps" in err
    assert "megappo: the built-in teacher of digit_max built in " in err
