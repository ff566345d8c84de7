"""`megappo train --dry-run` rejects what the run would reject at its start: prompts over max_prompt_length under
the configured truncation / filter_overlong_prompts, image files that are not there, a tool class that does not
load; and passes what the run would take."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megappo.cli import main

LONG = "count " * 200
REPO = Path(__file__).resolve().parents[2]


def _prompts(path, contents, images=None):
    n = len(contents)
    columns = {"data_source": ["openai/gsm8k"] * n,
               "prompt": [[{"role": "user", "content": c}] for c in contents],
               "reward_model": [{"style": "rule", "ground_truth": "2"}] * n}
    if images is not None:
        columns["images"] = images
    pq.write_table(pa.table(columns), path)
    return path


@pytest.fixture
def text_run(tmp_path, tokenizer_dir):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_key_value_heads": 2,
                                                   "num_hidden_layers": 4}))
    val = _prompts(tmp_path / "val.parquet", ["1+1?"] * 4)
    return ["--config", "gsm8k/tiny_cpu", f"actor_rollout_ref.model.path={model}", f"data.tokenizer={tokenizer_dir}",
            f"data.val_files={val}", "data.max_prompt_length=64", f"trainer.default_local_dir={tmp_path / 'out'}"]


def test_an_overlong_prompt_fails_the_dry_run_only_where_the_run_would_reject_it(text_run, tmp_path, capsys):
    train = _prompts(tmp_path / "train.parquet", ["1+1?"] * 4 + [LONG])
    run = ["train", "--dry-run", *text_run, f"data.train_files={train}", "data.truncation=error"]
    assert main([*run, "data.filter_overlong_prompts=false"]) == 1
    err = capsys.readouterr().err
    assert f"{train}, row 4, column 'prompt': the prompt has" in err and "over max_prompt_length=64" in err
    assert "Traceback" not in err and len(err.splitlines()) <= 2
    assert main([*run, "data.filter_overlong_prompts=true"]) == 0
    out = capsys.readouterr().out
    assert "train data: 4 prompts in 1 file(s)" in out and "1 filtered as overlong" in out and "config OK" in out
    assert main([*run, "data.filter_overlong_prompts=false", "data.truncation=left"]) == 0
    assert "1 truncated (left)" in capsys.readouterr().out


def test_a_misspelt_tool_class_fails_the_dry_run(tmp_path, capsys):
    tools = tmp_path / "tools.yaml"
    tools.write_text(((REPO / "recipes" / "cpu" / "tools" / "calculator.yaml").read_text()
                      .replace("calculator.CalculatorTool", "calculator.CalculaterTool")))
    rc = main(["train", "--dry-run", "--config", "recipes/cpu/tiny_tool_ppo.yaml",
               f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}"])
    err = capsys.readouterr().err
    assert rc == 1 and "actor_rollout_ref.rollout.multi_turn.tool_config_path" in err and str(tools) in err
    assert "CalculaterTool" in err and "did you mean 'CalculatorTool'?" in err and "Traceback" not in err
    assert main(["train", "--dry-run", "--config", "recipes/cpu/tiny_tool_ppo.yaml"]) == 0
    assert "tools: calculator" in capsys.readouterr().out


@pytest.fixture(scope="module")
def vlm_task(tmp_path_factory):
    from megappo.tasks import prepare_task

    return prepare_task("colour_square", str(tmp_path_factory.mktemp("colour_square")), num_train_prompts=8,
                        num_val_prompts=4, warm_start_steps=0, seed=1)


def test_an_image_file_that_is_not_there_fails_the_dry_run(vlm_task, tmp_path, capsys):
    table = pq.read_table(vlm_task.train_files)
    rows = table.to_pylist()
    (tmp_path / "there.png").write_bytes(rows[0]["images"][0]["bytes"])
    images = [[{"bytes": None, "path": "there.png"}]] * len(rows)
    images[3] = [{"bytes": None, "path": "gone.png"}]
    train = tmp_path / "train.parquet"
    pq.write_table(table.set_column(table.schema.get_field_index("images"), "images",
                                    pa.array(images, type=table.schema.field("images").type)), train)
    run = ["train", "--dry-run", "--config", "recipes/cpu/tiny_vlm_ppo.yaml", "data.synthetic.name=null",
           f"actor_rollout_ref.model.path={vlm_task.model_dir}", f"critic.model.path={vlm_task.model_dir}",
           f"data.val_files={vlm_task.val_files}", "data.train_batch_size=8",
           "actor_rollout_ref.actor.ppo_mini_batch_size=8", f"trainer.default_local_dir={tmp_path / 'out'}"]
    assert main([*run, f"data.train_files={train}"]) == 1
    err = capsys.readouterr().err
    assert f"{train}, row 3, column 'images': image file {tmp_path / 'gone.png'} not found" in err, err
    assert main([*run, f"data.train_files={vlm_task.train_files}"]) == 0, capsys.readouterr().err
    assert "8 image(s) found" in capsys.readouterr().out
