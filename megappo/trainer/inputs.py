"""The run's inputs as the trainer reads them: the tokenizer, the tool config's schemas, and the prompt datasets with
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


def tool_schemas(mt) -> Optional[list[dict]]:
    """The schemas the multi-turn tool config (`mt`: actor_rollout_ref.rollout.multi_turn) gives the chat template,
    after every class is imported and every schema checked (no tool is built); a config or class that cannot be
    loaded (a misspelt class_name, a missing file) is a ConfigError naming the key."""
    from megappo.multi_turn import tools

    try:
        tools.check_tools(mt)
        return tools.tool_schemas(mt.tool_config_path)
    except (tools.ToolConfigError, OSError) as e:
        raise ConfigError([f"{TOOL_KEY}={mt.tool_config_path}: {e}"]) from e


def load_data(cfg: MegappoConfig, tokenizer) -> tuple[Any, Optional[Any]]:
    """(train loader, validation loader or None)."""
    from megappo.data import PromptDataset, PromptLoader
    from megappo.kinds import kind_of

    d = cfg.data
    template_kwargs = {}
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    if mt.enable:  # the tools' schemas go to the chat template, as verl gives them
        template_kwargs["tools"] = tool_schemas(mt)

    # a vision-language actor's image processor and image tokens (None for a text model)
    path = cfg.actor_rollout_ref.model.path
    images = kind_of(path).image_processing(path, tokenizer, min_pixels=d.image_min_pixels,
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
