"""LoRA, in one place: the adapter layers on megatron's linear layers (`layers`), the object each role asks what
its adapters mean (`adapter`: checkpoints, the reference, the weight sync) and the config's LoRA checks (`checks`).
The PEFT adapter format, which needs the conversion's name mapping, is `megappo.convert.peft_io`.

Names resolve on first use, so the config's checks import no torch."""
from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "layers": ("TARGETS", "LoRASettings", "LoRAAdapter", "apply_lora", "share_base", "adapters", "lora_settings",
               "adapters_disabled", "merged_weights", "is_adapter_param", "is_lora_target_weight",
               "trainable_summary", "base_parameters", "adapted_weight_filter"),
    "adapter": ("FullParameters", "LoRA", "AdaptersOff", "AdapterShape", "for_role", "base_checksum", "check_lora_base",
                "read_lora_base", "LORA_BASE_FILE", "served_adapter"),
}
_WHERE = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
