"""megappo's configuration: one dataclass tree (schema), loaded from recipes and overrides, validated up front.

    from megappo.config import load_config, validate
    cfg = load_config("recipes/gsm8k_tiny_cpu.yaml", ["algorithm.kl_ctrl.type=adaptive"])
    validate(cfg)

Importing this package never imports torch or megatron.
"""
from megappo.config.fields import ConfigError
from megappo.config.loader import from_dict, load_config, resolve, to_dict, to_yaml
from megappo.config.schema import MegappoConfig
from megappo.config.validate import validate

__all__ = ["ConfigError", "MegappoConfig", "from_dict", "load_config", "resolve", "to_dict", "to_yaml", "validate"]
