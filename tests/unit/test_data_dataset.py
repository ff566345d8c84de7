"""megappo.data.dataset / schema: reading verl-schema Parquet by row groups, tokenising, length rules, errors."""
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer

from megappo.data import DataError, PromptDataset
from megappo.data.dataset import collate


def make_rows(n, start=0, words=3):
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"question {start + i} " + "apples " * (words + 4 * (i % 3))}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(start + i)},
            "extra_info": {"index": start + i, "split": "train"},
        }
        for i in range(n)
    ]


def write(path, rows, row_group_size=4, schema=None):
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), str(path), row_group_size=row_group_size)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def test_reads_files_in_row_groups_with_chat_template(tmp_path, tokenizer):
    a = write(tmp_path / "a.parquet", make_rows(10))
    b = write(tmp_path / "b.parquet", make_rows(5, start=10))
    assert pq.ParquetFile(a).num_row_groups == 3
    ds = PromptDataset([a, b], tokenizer, max_prompt_length=64, read_batch_rows=3)
    assert len(ds) == 15 and ds.uses_chat_template
    rec = ds[11]
    assert rec.file == b and rec.row.file_row == 1 and rec.row.ground_truth == "11"
    assert rec.row.extra_info == {"index": 11, "split": "train"} and rec.row.ability == "math"
    expected = "<|im_start|>user\nquestion 11 " + "apples " * 7 + "<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(rec.input_ids.tolist()) == expected


def test_prompt_batch_is_left_padded(tmp_path, tokenizer):
    ds = PromptDataset(write(tmp_path / "a.parquet", make_rows(6)), tokenizer, max_prompt_length=64)
    batch = ds.collate([0, 1, 2])
    lengths = [len(ds[i].input_ids) for i in (0, 1, 2)]
    assert lengths[0] < lengths[1] < lengths[2]
    P = max(lengths)
    assert batch.input_ids.shape == batch.attention_mask.shape == batch.position_ids.shape == (3, P)
    for b, n in enumerate(lengths):
        assert batch.attention_mask[b].tolist() == [0] * (P - n) + [1] * n
        assert batch.input_ids[b, : P - n].eq(tokenizer.pad_token_id).all()
        assert batch.input_ids[b, P - n:].tolist() == ds[b].input_ids.tolist()
        assert batch.position_ids[b].tolist() == [0] * (P - n) + list(range(n))
    assert batch.indices.tolist() == [0, 1, 2] and batch.ground_truths == ["0", "1", "2"]
    assert batch.data_sources == ["openai/gsm8k"] * 3 and batch.raw_prompts[1][0]["role"] == "user"
    assert batch.input_ids.dtype == torch.long
    assert ds.collate([0], pad_to=40).input_ids.shape == (1, 40)
    with pytest.raises(ValueError, match="shorter than the longest prompt"):
        collate([ds[2]], [2], 0, pad_to=2)


def test_plain_text_without_chat_template(tmp_path, tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.chat_template = None
    rows = make_rows(1)
    rows[0]["prompt"] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    ds = PromptDataset(write(tmp_path / "a.parquet", rows), tok, max_prompt_length=64)
    assert not ds.uses_chat_template
    assert tok.decode(ds[0].input_ids.tolist()) == "Be brief.\n2+2?"


def test_truncation_and_filtering(tmp_path, tokenizer):
    rows = make_rows(6)
    rows[4]["prompt"][0]["content"] = "apples " * 200
    path = write(tmp_path / "a.parquet", rows)
    full = PromptDataset(path, tokenizer, max_prompt_length=1024)[4].input_ids.tolist()
    with pytest.raises(DataError, match=r"a.parquet, row 4, column 'prompt': the prompt has \d+ tokens, over "
                       r"max_prompt_length=48.*filter_overlong_prompts=true.*truncation=left"):
        PromptDataset(path, tokenizer, max_prompt_length=48, truncation="error")
    left = PromptDataset(path, tokenizer, max_prompt_length=48, truncation="left")
    right = PromptDataset(path, tokenizer, max_prompt_length=48, truncation="right")
    assert left[4].input_ids.tolist() == full[-48:] and right[4].input_ids.tolist() == full[:48]
    assert left.num_truncated == 1 and len(left) == 6
    kept = PromptDataset(path, tokenizer, max_prompt_length=48, filter_overlong_prompts=True)
    assert len(kept) == 5 and kept.num_filtered == 1
    assert [r.row.ground_truth for r in kept.records] == ["0", "1", "2", "3", "5"]
    with pytest.raises(DataError, match="all 6 prompts are longer"):
        PromptDataset(path, tokenizer, max_prompt_length=2, filter_overlong_prompts=True)
    with pytest.raises(ValueError, match="error, left or right"):
        PromptDataset(path, tokenizer, truncation="middle")


def test_files_and_directories(tmp_path, tokenizer):
    d = tmp_path / "data"
    d.mkdir()
    write(d / "x.parquet", make_rows(2))
    write(d / "y.parquet", make_rows(3, start=2))
    assert len(PromptDataset(str(d), tokenizer)) == 5
    assert len(PromptDataset(os.path.join(str(d), "x.parquet"), tokenizer)) == 2
    with pytest.raises(DataError, match="missing.parquet: file not found.*`megappo data` converter of its dataset"):
        PromptDataset([str(d / "x.parquet"), str(d / "missing.parquet")], tokenizer)
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(DataError, match="no \\*.parquet files"):
        PromptDataset(str(empty_dir), tokenizer)


def test_malformed_files_name_file_row_and_column(tmp_path, tokenizer):
    def bad(rows, match, **kw):
        path = write(tmp_path / f"bad{len(os.listdir(tmp_path))}.parquet", rows, **kw)
        with pytest.raises(DataError, match=match) as info:
            PromptDataset(path, tokenizer)
        assert path in str(info.value) and "Fix:" in str(info.value)
        return info.value

    rows = make_rows(3)
    err = bad([{k: v for k, v in r.items() if k != "reward_model"} for r in rows], "column 'reward_model': missing")
    assert err.column == "reward_model" and err.row is None
    bad([dict(r, data_source=7) for r in rows], "column 'data_source': type int64 where string")
    bad([dict(r, prompt=r["prompt"][0]["content"]) for r in rows], "column 'prompt': type string where a list.*"
        "wrapped as")
    bad([dict(r, prompt=[{"role": "user", "text": "hi"}]) for r in rows], "messages with a string 'content'")
    bad([dict(r, reward_model={"style": "rule"}) for r in rows], "column 'reward_model'.*ground_truth")
    # Row numbers count over the whole file, across row groups.
    rows = make_rows(10)
    rows[9]["prompt"] = [{"role": "user", "content": None}]
    err = bad(rows, r"row 9, column 'prompt': message 0 has a null role or content", row_group_size=4)
    assert err.row == 9
    rows = make_rows(10)
    rows[6]["data_source"] = None
    bad(rows, "row 6, column 'data_source': data_source is null")
    rows = make_rows(3)
    rows[1]["prompt"] = []
    bad(rows, "row 1, column 'prompt': the prompt has no messages")
    bad([], "the file has no rows", schema=pa.Table.from_pylist(make_rows(1)).schema)


def test_prompt_key_names_the_messages_column(tmp_path, tokenizer):
    rows = [{("messages" if k == "prompt" else k): v for k, v in r.items()} for r in make_rows(2)]
    path = write(tmp_path / "a.parquet", rows)
    assert len(PromptDataset(path, tokenizer, prompt_key="messages")) == 2
    with pytest.raises(DataError, match="column 'prompt': missing column.*data.prompt_key"):
        PromptDataset(path, tokenizer)


def test_empty_and_non_parquet_files(tmp_path, tokenizer):
    empty = tmp_path / "empty.parquet"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match="empty.parquet: the file is empty"):
        PromptDataset(str(empty), tokenizer)
    jsonl = tmp_path / "train.parquet"
    jsonl.write_text('{"question": "q", "answer": "#### 1"}\n')
    with pytest.raises(DataError, match="train.parquet: not a Parquet file.*Fix: convert"):
        PromptDataset(str(jsonl), tokenizer)
