"""Local (one rank's) parameter names -> canonical names: the global layer and expert index, the local spec's
spelling. Shared by the conversion (`megappo.convert.mapping`) and the LoRA adapters, which are seeded by it."""
from __future__ import annotations

import re

# transformer-engine spec spellings of the local spec's separate norms (fused into the following linear).
_TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_LOCAL_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
_GROUPED_EXPERT_RE = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")  # TEGroupedMLP


def canonical_name(local: str, layer_numbers: list[int], expert_offset: int) -> str:
    """Canonical name of parameter `local` of one model chunk.

    layer_numbers: the chunk's `decoder.layers[j].layer_number` (1-based global); expert_offset: ep_rank *
    num_local_experts.
    """
    m = _LAYER_RE.match(local)
    if not m:
        return local
    rest = m.group(2)
    rest = _TE_ALIASES.get(rest, rest)
    if (x := _LOCAL_EXPERT_RE.match(rest)) is not None:
        rest = f"mlp.experts.local_experts.{int(x.group(1)) + expert_offset}.{x.group(2)}"
    elif (x := _GROUPED_EXPERT_RE.match(rest)) is not None:
        rest = f"mlp.experts.local_experts.{int(x.group(2)) + expert_offset}.{x.group(1)}.weight"
    return f"decoder.layers.{layer_numbers[int(m.group(1))] - 1}.{rest}"
