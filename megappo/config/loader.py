"""Building a `MegappoConfig`: defaults, then a YAML recipe, then dotted command-line overrides.

    cfg = load_config("recipes/gsm8k/tiny_cpu.yaml", ["actor_rollout_ref.actor.use_kl_loss=true"])

Every problem in every source is collected and raised as one `ConfigError`: an unknown key names the closest
valid key, a wrong value names the key and the expected type. `${a.b.c}` references to other keys are resolved
after merging, then `derived.resolve` fills the derived defaults (the one place they live).
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import yaml

from megappo.config.fields import (
    CoerceError,
    ConfigError,
    accepts_str,
    all_keys,
    allows_none,
    coerce,
    field_names,
    hints,
    is_group,
    is_mapping_type,
    iter_leaves,
    type_name,
)
from megappo.config.derived import resolve
from megappo.config.schema import MegappoConfig, RolloutCorrectionConfig

# Where `--config NAME` looks when NAME is not a file: the repository's recipes/ folder and its subfolders.
RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
_NULLS = {"null", "~", "None", "none"}
# Short names megatron, slime and NeMo-RL users type for the megatron keys.
_ABBREVIATIONS = {
    "tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size", "cp": "context_parallel_size",
    "vpp": "virtual_pipeline_model_parallel_size", "ep": "expert_model_parallel_size",
    "etp": "expert_tensor_parallel_size", "sp": "sequence_parallel",
    # verl's older optimiser names
    "warmup_style": "lr_scheduler", "lr_decay_style": "lr_scheduler",
}
# Paths a recipe names that mean a file beside the recipe (`recipe_relative`).
RECIPE_RELATIVE_KEYS = ("actor_rollout_ref.rollout.multi_turn.tool_config_path",
                        "actor_rollout_ref.rollout.agent.agent_loop_config_path")
_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
_REF = re.compile(r"\$\{([A-Za-z0-9_.]+)\}")


def load_config(
    recipe: Union[str, Path, Mapping, None] = None, overrides: Sequence[str] = ()
) -> MegappoConfig:
    """Defaults <- recipe (a YAML path, a recipe name under recipes/, or a mapping) <- `key=value` overrides.

    With algorithm.rollout_correction.preset, the defaults are the preset's fields and the recipe and the
    overrides are applied again over them, so a key the user set explicitly wins over the preset."""
    data, source = {}, ""
    if recipe is not None:
        if isinstance(recipe, Mapping):
            data, source = recipe, "the given mapping"
        else:
            path = find_recipe(recipe)
            data, source = read_recipe(path), str(path)
    base_dir = None if recipe is None or isinstance(recipe, Mapping) else path.parent
    cfg, errors = _apply(MegappoConfig(), data, source, overrides, base_dir)
    preset = cfg.algorithm.rollout_correction.preset
    if not errors and preset is not None:
        base = MegappoConfig()
        try:
            base.algorithm.rollout_correction = RolloutCorrectionConfig(**_preset_fields(preset), preset=preset)
        except ValueError as e:
            errors.append(str(e))
        else:
            cfg, errors = _apply(base, data, source, overrides, base_dir)
    if not errors:
        _interpolate(cfg, errors)
    if errors:
        raise ConfigError(errors)
    return resolve(cfg)


def _apply(cfg: MegappoConfig, data: Mapping, source: str, overrides: Sequence[str], base_dir: Optional[Path]
           ) -> tuple[MegappoConfig, list[str]]:
    """The recipe's keys (its paths resolved against `base_dir`, the recipe's folder), then the overrides."""
    errors: list[str] = []
    for key, value in data.items():
        _set(cfg, str(key), value, source, errors, cli=False)
    if base_dir is not None:
        _resolve_recipe_paths(cfg, base_dir)
    for override in overrides:
        key, value = _split_override(override, errors)
        if key is not None:
            _set(cfg, key, value, "command line", errors, cli=True)
    return cfg, errors


def _preset_fields(name: str) -> dict[str, Any]:
    from megappo.algos.estimators import suggest
    from megappo.config.rollout_presets import PRESETS

    if name not in PRESETS:
        raise ValueError(f"algorithm.rollout_correction.preset: unknown preset {name!r}{suggest(name, PRESETS)} "
                         f"(valid: {', '.join(PRESETS)})")
    return dict(PRESETS[name])


def from_dict(data: Mapping) -> MegappoConfig:
    """Rebuild a config saved with `to_dict` / `to_yaml` (e.g. from a checkpoint)."""
    return load_config(data)


def to_dict(cfg: MegappoConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


class _Dumper(yaml.SafeDumper):
    """Block style for the tree, flow style for lists of scalars ([0.9, 0.999]): reads like a recipe."""


def _represent_list(dumper: yaml.SafeDumper, data: list) -> yaml.Node:
    flat = all(not isinstance(v, (list, dict)) for v in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flat)


_Dumper.add_representer(list, _represent_list)


def to_yaml(cfg: MegappoConfig) -> str:
    """The resolved tree as YAML; it loads back with `load_config(path)` to the same config."""
    return yaml.dump(to_dict(cfg), Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)


def find_recipe(recipe: Union[str, Path]) -> Path:
    """A YAML file: `recipe` itself when it is a file, else a recipe under recipes/ named by its path there with or
    without `.yaml` (`gsm8k/tiny_cpu`, `recipes/gsm8k/tiny_cpu.yaml`), or by its bare name when only one recipe in
    any subfolder has it (`tiny_cpu`)."""
    path = Path(recipe).expanduser()
    if path.is_file():
        return path
    known = bundled_recipes()
    if not path.is_absolute():
        rel = Path(*path.parts[1:]) if path.parts[:1] == ("recipes",) and len(path.parts) > 1 else path
        name = (rel.with_suffix("") if rel.suffix in (".yaml", ".yml") else rel).as_posix()
        if name in known:
            return known[name]
        if not rel.parent.parts:  # a bare name: the one recipe of that name in any subfolder
            same = sorted(k for k in known if k.rsplit("/", 1)[-1] == name)
            if len(same) == 1:
                return known[same[0]]
            if same:
                raise ConfigError([f"--config: '{recipe}' names several recipes ({', '.join(same)}); "
                                   "pass one of these names"])
    hint = f"; bundled recipes: {', '.join(sorted(known))}" if known else ""
    raise ConfigError([f"--config: recipe file '{recipe}' not found; pass a YAML path{hint}"])


def bundled_recipes() -> dict[str, Path]:
    """Every recipe under recipes/ (any depth), by its name for `--config`: the path there without `.yaml`. Files in
    a `tools/` or `agents/` folder are tool and agent configs (rollout.multi_turn.tool_config_path,
    rollout.agent.agent_loop_config_path), not recipes."""
    if not RECIPES_DIR.is_dir():
        return {}
    return {p.relative_to(RECIPES_DIR).with_suffix("").as_posix(): p for p in sorted(RECIPES_DIR.rglob("*.yaml"))
            if not {"tools", "agents"} & set(p.relative_to(RECIPES_DIR).parts[:-1])}


def recipe_relative(path: str, base_dir: Union[str, Path, None]) -> str:
    """A path that a YAML file in `base_dir` names, as its author meant it: `~` expanded, absolute as given,
    relative against `base_dir` (so a recipe runs from any working directory); a relative path that exists only
    from the working directory still means that file (older recipes wrote paths from the repository root)."""
    expanded = os.path.expanduser(path)
    if os.path.isabs(expanded) or base_dir is None:
        return expanded
    beside = os.path.abspath(os.path.join(os.path.expanduser(str(base_dir)), expanded))
    if os.path.exists(beside) or not os.path.exists(expanded):
        return beside
    return expanded


def _resolve_recipe_paths(cfg: MegappoConfig, base_dir: Path) -> None:
    """`RECIPE_RELATIVE_KEYS` as set by the recipe in `base_dir` (command-line values, set later, mean the working
    directory)."""
    for key in RECIPE_RELATIVE_KEYS:
        *groups, name = key.split(".")
        node: Any = cfg
        for g in groups:
            node = getattr(node, g)
        value = getattr(node, name)
        if isinstance(value, str) and value and "${" not in value:
            setattr(node, name, recipe_relative(value, base_dir))


def read_recipe(path: Path) -> Mapping:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ConfigError([f"{path}: not valid YAML: {e}"]) from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError([f"{path}: a recipe must be a mapping of keys to values, got {type(data).__name__}"])
    if "defaults" in data:
        raise ConfigError([
            f"{path}: 'defaults:' is a Hydra list; megappo recipes only override the built-in defaults, so "
            "remove it and keep just the keys you change"
        ])
    return data


# ------------------------------------------------------------------------------------------------------------------
# merging
# ------------------------------------------------------------------------------------------------------------------
def _split_override(text: str, errors: list[str]) -> tuple[Optional[str], Optional[str]]:
    key, sep, value = text.partition("=")
    key = key.strip().lstrip("+")  # Hydra's +key= / ++key= mean "add"; every key exists here already
    if not sep or not key:
        errors.append(f"override '{text}': expected key=value, e.g. actor_rollout_ref.actor.optim.lr=1e-6")
        return None, None
    if key.startswith("~"):
        errors.append(f"override '{text}': keys cannot be deleted; set the value instead (null where allowed)")
        return None, None
    return key, value


def _set(cfg: MegappoConfig, key: str, value: Any, source: str, errors: list[str], *, cli: bool) -> None:
    """Set a dotted `key` (a group takes a mapping) on the tree, appending any problem to `errors`."""
    node: Any = cfg
    parts = key.split(".")
    for i, name in enumerate(parts):
        path = ".".join(parts[: i + 1])
        if name not in field_names(type(node)):
            errors.append(_unknown_key(key, i, type(node), source))
            return
        tp = hints(type(node))[name]
        rest = parts[i + 1:]
        if is_group(tp):
            if rest:
                node = getattr(node, name)
                continue
            if isinstance(value, Mapping):
                for k, v in value.items():
                    _set(cfg, f"{path}.{k}", v, source, errors, cli=cli)
            else:
                first = field_names(tp)[0]
                errors.append(f"{path} is a group of settings, not a value ({source}); set its keys, e.g. "
                              f"{path}.{first}=...")
            return
        if is_mapping_type(tp):
            _set_mapping(node, name, rest, value, path, source, errors, cli=cli)
            return
        if rest:
            errors.append(f"unknown key '{key}' ({source}): {path} is {type_name(tp)} and has no sub-keys; "
                          f"set it as {path}=VALUE")
            return
        try:
            new = coerce(_parse_cli(value, tp) if cli else value, tp, allow_interpolation=True)
        except CoerceError as e:
            errors.append(f"{path}: expected {e}, got {value!r} ({source})")
            return
        setattr(node, name, new)
        return


def _set_mapping(node: Any, name: str, rest: list[str], value: Any, path: str, source: str, errors: list[str],
                 *, cli: bool) -> None:
    """Free-form mappings (engine_kwargs, override_config) take any nested keys; a mapping value merges in."""
    if cli:
        value = _parse_yaml_value(value)
    if not rest and value is None:
        setattr(node, name, {})
        return
    if not rest and not isinstance(value, Mapping):
        errors.append(f"{path}: expected a mapping, got {value!r} ({source}); set one key with {path}.KEY=VALUE "
                      f"or all with {path}={{key: value}}")
        return
    target = dict(getattr(node, name))
    inner = target
    for part in rest[:-1]:
        child = inner.get(part)
        inner[part] = child = dict(child) if isinstance(child, dict) else {}
        inner = child
    if rest:
        inner[rest[-1]] = value
    else:
        target.update(value)
    setattr(node, name, target)


def _parse_cli(raw: Any, tp: Any) -> Any:
    """A command-line value as the user meant it: `null` is None, strings stay strings, the rest is YAML."""
    if not isinstance(raw, str):
        return raw
    text = raw.strip()
    if text in _NULLS and allows_none(tp):
        return None
    if accepts_str(tp) and not text.startswith(("[", "{")):
        return _unquote(text)
    return _parse_yaml_value(text)


def _parse_yaml_value(text: str) -> Any:
    try:
        value = yaml.safe_load(text) if text.strip() else text
    except yaml.YAMLError:
        return text
    if isinstance(value, str) and _FLOAT.fullmatch(value):
        return float(value)  # PyYAML (YAML 1.1) reads 1e-6 as a string
    return value


def _unquote(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


# ------------------------------------------------------------------------------------------------------------------
# unknown keys
# ------------------------------------------------------------------------------------------------------------------
def _unknown_key(key: str, bad: int, parent: type, source: str) -> str:
    parts = key.split(".")
    prefix = ".".join(parts[:bad])
    suggestion = suggest_key(key, bad, parent)
    if suggestion:
        return f"unknown key '{key}' ({source}); did you mean '{suggestion}'?"
    where = f"under '{prefix}'" if prefix else "at the top level"
    return f"unknown key '{key}' ({source}); valid keys {where}: {', '.join(field_names(parent))}"


def suggest_key(key: str, bad: int, parent: type) -> Optional[str]:
    """The closest valid dotted key: a sibling typo, the same name in another group, or the closest key under the
    longest dotted prefix the two share (the same section first), falling back to the closest full path."""
    parts = key.split(".")
    prefix = ".".join(parts[:bad])
    keys = all_keys(MegappoConfig)
    join = (lambda *p: ".".join(x for x in p if x))
    siblings = field_names(parent)
    name = _ABBREVIATIONS.get(parts[bad], parts[bad])
    # 1. an abbreviation or a shortened sibling (verl's deprecated ppo_micro_batch_size -> ..._per_gpu), then a
    #    typo of a sibling; complete the rest of the path when it fits under the corrected name
    close = [s for s in siblings if s == name] or sorted((s for s in siblings if s.startswith(name)), key=len)[:1]
    close = close or difflib.get_close_matches(name, siblings, n=1, cutoff=0.6)
    if close:
        fixed = join(prefix, close[0], *parts[bad + 1:])
        return fixed if fixed in keys else join(prefix, close[0])
    # 2. a level too many (verl's reward_model.model.path -> reward_model.path), then the same final name in another
    #    group
    if bad + 1 < len(parts) and (flat := join(prefix, *parts[bad + 1:])) in keys:
        return flat
    same_name = [k for k in keys if k.rsplit(".", 1)[-1] == parts[-1]]
    if same_name:
        return max(same_name, key=lambda k: difflib.SequenceMatcher(None, key, k).ratio())
    # 3. the closest key in the nearest enclosing section: the rest of the path is compared with the keys under
    #    the longest dotted prefix first, then with those one level up (less the section already judged, whose
    #    shared prefix would inflate their score), and so on to the top level. None: the message lists the
    #    section's keys instead
    for level in range(bad, -1, -1):
        section, judged = ".".join(parts[:level]), ".".join(parts[:level + 1]) + "."
        rest = ".".join(parts[level:])
        under = {k[len(section) + 1:] if section else k: k for k in keys
                 if (not section or k.startswith(section + ".")) and (level == bad or not k.startswith(judged))}
        close = difflib.get_close_matches(rest, list(under), n=1, cutoff=0.6)
        if close and not key.startswith(under[close[0]] + "."):
            return under[close[0]]
    return None


# ------------------------------------------------------------------------------------------------------------------
# ${key} references and derived defaults
# ------------------------------------------------------------------------------------------------------------------
def _get(cfg: MegappoConfig, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        if not dataclasses.is_dataclass(node) or part not in field_names(type(node)):
            raise KeyError(key)
        node = getattr(node, part)
    return node


def _interpolate(cfg: MegappoConfig, errors: list[str]) -> None:
    """Replace `${a.b}` in string values by the referenced value (typed when the whole value is one reference)."""

    def value_of(key: str, stack: tuple[str, ...]) -> Any:
        if key in stack:
            raise ValueError(f"circular reference {' -> '.join(stack + (key,))}")
        value = _get(cfg, key)
        if isinstance(value, str) and "${" in value:
            return expand(value, stack + (key,))
        return value

    def expand(text: str, stack: tuple[str, ...]) -> Any:
        whole = _REF.fullmatch(text)
        if whole:
            return value_of(whole.group(1), stack)
        return _REF.sub(lambda m: str(value_of(m.group(1), stack)), text)

    for key, value, tp, owner in list(iter_leaves(cfg)):
        if not (isinstance(value, str) and "${" in value):
            continue
        try:
            new = expand(value, (key,))
        except KeyError as e:
            ref = str(e.args[0])
            hint = difflib.get_close_matches(ref, all_keys(MegappoConfig), n=1, cutoff=0.5)
            errors.append(f"{key}: '{value}' refers to unknown key '{ref}'"
                          + (f"; did you mean '{hint[0]}'?" if hint else ""))
            continue
        except ValueError as e:
            errors.append(f"{key}: {e}")
            continue
        try:
            setattr(owner, key.rsplit(".", 1)[-1], coerce(new, tp))
        except CoerceError as err:
            errors.append(f"{key}: expected {err}, got {new!r} (from '{value}')")
