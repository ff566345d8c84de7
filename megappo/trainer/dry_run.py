"""`megappo train --dry-run`, past preflight: the inputs the run reads at start, read as the run reads them.

The tool config's classes are imported and their schemas checked (multi-turn; no tool is built), the agents of
rollout.agent.agent_loop_config_path listed (preflight has loaded their code), the tokenizer is loaded, and every
prompt of the train and validation files rendered with the chat template, its `<image>`s expanded (each image file
opened, its header read) and tokenised, under the run's own length rules (data.max_prompt_length with data.truncation /
data.filter_overlong_prompts): what the run would reject raises here, with the same message. Not checked: an image's
pixels beyond its header (decoded when its batch is collated), model weights (loaded by the run), what a tool does
when called, and the prompts of a synthetic task, whose model and data the run writes itself.
"""
from __future__ import annotations

import copy
import sys

from megappo.config import resolve
from megappo.config.schema import MegappoConfig
from megappo.data.images import images_found


def check_inputs(cfg: MegappoConfig, out=None) -> None:
    """Raise what the run would raise on its inputs (DataError, ConfigError); print one line per dataset."""
    out = out or sys.stdout
    from megappo.trainer.inputs import load_data, load_tokenizer, tool_schemas

    mt = cfg.actor_rollout_ref.rollout.multi_turn
    if mt.enable:
        names = [s.get("function", {}).get("name", "?") for s in tool_schemas(mt) or ()]
        print(f"megappo train: tools: {', '.join(names) or 'none'} ({mt.tool_config_path})", file=out)
    agents = cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path
    if agents:  # preflight loaded each entry's code; the line says what the rows' agent_name can name
        from megappo.envs.registry import read_agent_config

        named = [f"{e['name']} ({e.get('environment') or e.get('agent')})" for e in read_agent_config(agents)]
        print(f"megappo train: agents: {', '.join(named) or 'none'} ({agents})", file=out)
    if cfg.data.synthetic.name:
        return
    cfg = resolve(copy.deepcopy(cfg))
    train, val = load_data(cfg, load_tokenizer(cfg))
    for name, loader in (("train", train), ("validation", val)):
        if loader is not None:
            print(f"megappo train: {name} data: {describe(loader.dataset)}", file=out)


def describe(dataset) -> str:
    """'N prompts (longest L tokens of max_prompt_length M; F filtered, T truncated)'."""
    longest = max(len(r.input_ids) for r in dataset.records)
    notes = [f"longest {longest} tokens of max_prompt_length={dataset.max_prompt_length}"]
    if dataset.num_filtered:
        notes.append(f"{dataset.num_filtered} filtered as overlong")
    if dataset.num_truncated:
        notes.append(f"{dataset.num_truncated} truncated ({dataset.truncation})")
    notes += images_found([r.images for r in dataset.records])
    return f"{len(dataset)} prompts in {len(dataset.files)} file(s) ({'; '.join(notes)})"
