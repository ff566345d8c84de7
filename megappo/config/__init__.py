"""megappo's configuration: one dataclass tree (schema), loaded from recipes and overrides, validated up front.

    from megappo.config import load_config, validate
    cfg = load_config("gsm8k/tiny_cpu", ["algorithm.kl_ctrl.type=adaptive"])
    validate(cfg)

`validate` checks the configuration's own rules; `megappo.trainer.preflight` adds the checks that need the rest
of megappo (parallel layouts, batch divisibility, the model's config.json, data schema, reward function).
Importing this package never imports torch or megatron, nor any of megappo outside megappo.config; checking a config
loads, when it runs, the rules that live with what they check (algos, data, distill, models.lora, rollout's engine
registry): distill's, LoRA's and the engines' stand above config in `megappo.testing.structure.PACKAGE_ORDER`.
"""
from megappo.config.derived import resolve
from megappo.config.fields import ConfigError
from megappo.config.loader import from_dict, load_config, to_dict, to_yaml
from megappo.config.schema import MegappoConfig
from megappo.config.validate import validate

__all__ = ["ConfigError", "MegappoConfig", "from_dict", "load_config", "resolve", "to_dict", "to_yaml", "validate"]
