"""The parallel layout: sizes, derived data-parallel size, and validation before any model is built.

Pure Python (no torch): the trainer's preflight (`megappo.trainer.preflight`) and the process-group setup both
call `check_layout`, so an impossible layout fails before any rank starts work, with a message that names the fix.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


class LayoutError(ValueError):
    """An impossible parallel layout; the message names the fix."""


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1  # tensor model parallel
    pp: int = 1  # pipeline model parallel
    vpp: Optional[int] = None  # virtual pipeline stages per pipeline rank
    cp: int = 1  # context parallel
    ep: int = 1  # expert model parallel
    etp: Optional[int] = None  # expert tensor parallel (None = tp)
    sequence_parallel: bool = False

    def dp(self, world_size: int) -> int:
        """Data-parallel size: world / (tp * pp * cp)."""
        return world_size // (self.tp * self.pp * self.cp)

    @classmethod
    def from_megatron_config(cls, m) -> "ParallelLayout":
        """From a config tree's `*.megatron` group (verl's names: tensor_model_parallel_size, ...)."""
        return cls(tp=m.tensor_model_parallel_size, pp=m.pipeline_model_parallel_size,
                   vpp=m.virtual_pipeline_model_parallel_size, cp=m.context_parallel_size,
                   ep=m.expert_model_parallel_size, etp=m.expert_tensor_parallel_size,
                   sequence_parallel=m.sequence_parallel)


def _divisors_hint(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def check_layout(
    layout: ParallelLayout,
    world_size: int,
    *,
    num_attention_heads: Optional[int] = None,
    num_key_value_heads: Optional[int] = None,
    num_layers: Optional[int] = None,
    num_experts: Optional[int] = None,
    prefix: str = "actor_rollout_ref.actor.megatron",
) -> None:
    """Raise LayoutError naming the config key and a valid value when `layout` cannot run on `world_size` ranks.

    Model dimensions are optional: without them only the world-size rules are checked.
    """
    for name in ("tp", "pp", "cp", "ep"):
        if getattr(layout, name) < 1:
            raise LayoutError(f"{prefix}: {name} size must be >= 1, got {getattr(layout, name)}")
    key = {
        "tp": f"{prefix}.tensor_model_parallel_size",
        "pp": f"{prefix}.pipeline_model_parallel_size",
        "vpp": f"{prefix}.virtual_pipeline_model_parallel_size",
        "cp": f"{prefix}.context_parallel_size",
        "ep": f"{prefix}.expert_model_parallel_size",
    }
    model_parallel = layout.tp * layout.pp * layout.cp
    if world_size % model_parallel:
        raise LayoutError(
            f"world size {world_size} is not divisible by tp*pp*cp = {layout.tp}*{layout.pp}*{layout.cp} = "
            f"{model_parallel}; choose sizes whose product divides {world_size} (divisors: "
            f"{_divisors_hint(world_size)}) or change trainer.nnodes * trainer.n_gpus_per_node"
        )
    dp = layout.dp(world_size)
    etp = layout.etp or layout.tp
    expert_mp = etp * layout.ep * layout.pp
    if world_size % expert_mp:
        raise LayoutError(
            f"world size {world_size} is not divisible by expert_tp*ep*pp = {etp}*{layout.ep}*{layout.pp}; "
            f"set {key['ep']} to a divisor of {world_size // (etp * layout.pp) if world_size % (etp * layout.pp) == 0 else 1}"
        )
    if layout.ep > 1 and (dp * layout.cp * layout.tp) % (layout.ep * etp):
        raise LayoutError(
            f"{key['ep']}={layout.ep} (expert tp {etp}) does not fit in dp*cp*tp = {dp * layout.cp * layout.tp} "
            f"ranks per pipeline stage; lower {key['ep']}"
        )
    if layout.sequence_parallel and layout.tp == 1:
        raise LayoutError(f"{prefix}.sequence_parallel=true needs {key['tp']} > 1; set it to false")
    if layout.vpp is not None and layout.vpp > 1 and layout.pp == 1:
        raise LayoutError(f"{key['vpp']}={layout.vpp} needs {key['pp']} > 1; unset it or raise {key['pp']}")
    if num_attention_heads is not None and num_attention_heads % layout.tp:
        raise LayoutError(
            f"{key['tp']}={layout.tp} does not divide num_attention_heads={num_attention_heads}; use one of "
            f"{_divisors_hint(num_attention_heads)}"
        )
    if num_key_value_heads is not None and num_key_value_heads % layout.tp:
        raise LayoutError(
            f"{key['tp']}={layout.tp} does not divide num_key_value_heads={num_key_value_heads}; use one of "
            f"{_divisors_hint(num_key_value_heads)}"
        )
    if num_layers is not None:
        stages = layout.pp * (layout.vpp or 1)
        if num_layers % stages:
            raise LayoutError(
                f"num_hidden_layers={num_layers} is not divisible by pp*vpp = {stages}; choose "
                f"{key['pp']} (times {key['vpp']}) among {_divisors_hint(num_layers)}"
            )
    if layout.ep > 1:
        if not num_experts and num_experts is not None:
            raise LayoutError(f"{key['ep']}={layout.ep} but the model has no experts; set it to 1")
        if num_experts and num_experts % layout.ep:
            raise LayoutError(
                f"{key['ep']}={layout.ep} does not divide num_experts={num_experts}; use one of "
                f"{_divisors_hint(num_experts)}"
            )
