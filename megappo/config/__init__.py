"""megappo's configuration: one dataclass tree (schema) and its loading from recipes and overrides.

    from megappo.config import load_config
    from megappo.checks import validate
    cfg = load_config("gsm8k/tiny_cpu", ["algorithm.kl_ctrl.type=adaptive"])
    validate(cfg)

`megappo.config.validate` holds the tree's own rules (types, ranges); the rules of what each capability supports
live beside it, and `megappo.checks` runs them all as one table; `megappo.trainer.preflight` adds the checks that
need the files and the world (parallel layouts, batch divisibility, the model's config.json, data schema).
Importing this package never imports torch or megatron, nor any of megappo outside megappo.config.
"""
from megappo.config.derived import resolve
from megappo.config.fields import ConfigError
from megappo.config.loader import from_dict, load_config, to_dict, to_yaml
from megappo.config.schema import MegappoConfig

__all__ = ["ConfigError", "MegappoConfig", "from_dict", "load_config", "resolve", "to_dict", "to_yaml"]
