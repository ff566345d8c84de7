"""The run's inputs as the trainer reads them: the tokenizer, the tool config's tools, and the prompt datasets with
their length rules and image headers applied. `fit` builds them at start, and `megappo train --dry-run` builds the
same ones, so the dry run rejects exactly what the run would.

Light to import: no megatron.
"""
from __future__ import annotations

from typing import Any, Optional

from megappo.config import ConfigError
from megappo.config.schema import MegappoConfig

TOOL_KEY = "actor_rollout_ref.rollout.multi_turn.tool_config_path"


def load_tokenizer(cfg: MegappoConfig):
    from transformers import AutoTokenizer

    model = cfg.actor_rollout_ref.model
    return AutoTokenizer.from_pretrained(cfg.data.tokenizer or model.tokenizer_path or model.path,
                                         trust_remote_code=model.trust_remote_code)


def load_tool_config(path: Optional[str]) -> dict:
    """The tools of a multi-turn tool config by name; a config or class that cannot be loaded (a misspelt
    class_name, a missing file) is a ConfigError naming the key."""
    import yaml

    from megappo.multi_turn import tools

    try:
        return tools.load_tools(path)
    except (ValueError, ImportError, OSError, yaml.YAMLError) as e:
        raise ConfigError([f"{TOOL_KEY}={path}: {e}; fix the tool config (class_name: package.module.Class or "
                           "path/to/file.py:Class)"]) from e


def load_data(cfg: MegappoConfig, tokenizer) -> tuple[Any, Optional[Any]]:
    """(train loader, validation loader or None)."""
    from megappo.data import PromptDataset, PromptLoader
    from megappo.data.images import ImageProcessing

    d = cfg.data
    template_kwargs = {}
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    if mt.enable:  # the tools' schemas go to the chat template, as verl gives them
        template_kwargs["tools"] = [t.tool_schema for t in load_tool_config(mt.tool_config_path).values()] or None

    # a vision-language actor's image processor and image tokens (None for a text model)
    images = ImageProcessing.from_model(cfg.actor_rollout_ref.model.path, tokenizer, min_pixels=d.image_min_pixels,
                                        max_pixels=d.image_max_pixels)

    def dataset(files):
        return PromptDataset(files, tokenizer, max_prompt_length=d.max_prompt_length, truncation=d.truncation,
                             filter_overlong_prompts=d.filter_overlong_prompts, prompt_key=d.prompt_key,
                             chat_template_kwargs=template_kwargs or None, image_processing=images,
                             image_key=d.image_key)

    # a loader batch is a generation batch: train_batch_size prompts unless algorithm.filter_groups generates more
    train = PromptLoader(dataset(d.train_files), d.gen_batch_size, shuffle=d.shuffle, seed=d.seed)
    val = None
    if d.val_files:
        val_set = dataset(d.val_files)
        val = PromptLoader(val_set, d.val_batch_size or len(val_set), shuffle=False, drop_last=False)
    return train, val
