"""docs/configuration.md is the page `megappo.config.reference` generates from the config tree, so the reference
and the schema cannot drift; the page has every key with its type, default and source comment."""
from __future__ import annotations

from pathlib import Path

from megappo.config.fields import all_keys, hints
from megappo.config.reference import REGENERATE, field_comments, main, render, sections
from megappo.config.schema import MegappoConfig, RolloutConfig

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "configuration.md"


def test_the_page_is_the_generated_reference():
    assert PAGE.read_text() == render(), f"docs/configuration.md is stale; regenerate it: {REGENERATE}"


def test_every_key_of_the_tree_is_on_the_page():
    leaves = {k.path for s in sections() for k in s.keys}
    groups = {s.path for s in sections()} - {""}
    assert leaves | groups == set(all_keys(MegappoConfig))
    text = render()
    assert all(f"| `{key}` |" in text for key in leaves)
    assert all(f"## `{group}`" in text for group in groups)


def test_types_defaults_and_comments_come_from_the_source():
    keys = {k.path: k for s in sections() for k in s.keys}
    lr = keys["critic.optim.lr"]  # a group made by its own factory keeps its own default
    assert lr.default == "1e-05" and keys["actor_rollout_ref.actor.optim.lr"].default == "1e-06"
    dtype = keys["actor_rollout_ref.model.dtype"]  # an alias (DType) spelt out
    assert dtype.type == 'Optional[Literal["bfloat16", "float16", "float32"]]' and dtype.default == "null"
    # a comment after the field, and comment lines above it
    assert keys["algorithm.kl_ctrl.kl_coef"].doc.startswith("coefficient of the in-reward KL penalty")
    assert keys["actor_rollout_ref.rollout.name"].doc.startswith("The engine (megappo/rollout/registry.py)")
    assert keys["trainer.logger"].type == 'list[Literal["console", "tensorboard", "wandb"]]'
    assert keys["trainer.logger"].default == '["console", "tensorboard"]'
    # every field of a class is read from its source (a field under another's comment has none of its own)
    comments = field_comments(RolloutConfig)
    assert set(comments) == set(hints(RolloutConfig)) and comments["server_urls"].startswith("servers (sglang")
    assert comments["health_check_timeout_s"] == ""


def test_the_check_mode(tmp_path, capsys):
    assert main(["--check", str(PAGE)]) == 0
    stale = tmp_path / "configuration.md"
    stale.write_text(render().replace("| `data.seed` |", "| `data.sed` |"))
    assert main(["--check", str(stale)]) == 1
    assert REGENERATE in capsys.readouterr().err
