"""LoRA adapters on megatron-core's tensor-parallel linear layers, over a frozen base.

`apply_lora(chunks, settings)` freezes every parameter of the model chunks and attaches an adapter
(`<linear>.lora.lora_A`, `<linear>.lora.lora_B`) to each targeted linear layer; a forward hook adds
`scaling * B(A(dropout(x)))` to the layer's output. The base parameters keep their names, so the conversion code,
the weight sync and megatron's DDP (which skips parameters without gradients: no grad buffer, no optimizer state)
see the model they know.

Sharding follows the base weight (megatron's TP layouts):
- column-parallel (`linear_qkv`, `linear_fc1`): the weight is split along its output, so is B ([out/tp, r]); A
  ([r, in]) is replicated. B's rows follow the weight's rows, so the fused layouts (qkv interleaved per query group,
  fc1's gate/up halves per rank) need nothing special: merging and PEFT export split B as the conversion code splits
  the weight (`megappo.convert.mapping.merge_to_hf`).
- row-parallel (`linear_proj`, `linear_fc2`): the weight is split along its input, so is A ([r, in/tp]); B
  ([out, r]) is replicated.
The small rank-r activations carry the communication: column-parallel copies `x A^T` into the TP region (its
gradient is summed over TP, so A's gradient and the input's are whole on every rank), row-parallel sums `x A_i^T`
over TP before B (so B's gradient is whole). With sequence parallelism the same tensors are gathered / reduce-
scattered along the sequence, and the replicated factor is flagged `sequence_parallel` so megatron sums its
gradient over TP. A merged weight shard is `W_i + scaling * B_i A_i` on each rank without communication.

Each adapted chunk carries `megappo_checkpoint_keys` (`saved_key`): `megappo.models.checkpoint` saves and loads only
the entries it keeps, the adapters and a critic's value head.

`adapters_disabled(chunks)` turns the adapters off: the base model, i.e. the reference policy, without a copy.
`share_base(critic, actor)` gives a LoRA critic the actor's frozen base tensors (`critic.model.lora.share_actor_base`).
"""
from __future__ import annotations

import contextlib
import functools
import math
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megappo.models.lora.checks import TARGETS
COLUMN, ROW = "column", "row"


@dataclass
class LoRASettings:
    """The adapter shape (verl's `model.lora.{rank, alpha, dropout, target_modules, exclude_modules}`), mapped from
    the config by `megappo.trainer.settings.lora_settings` (the defaults are the schema's `LoRAConfig`'s)."""

    rank: int  # 0: no LoRA
    alpha: float
    dropout: float
    target_modules: Sequence[str]
    exclude_modules: Sequence[str]
    a_init: str  # lora_A_init_method: "xavier" or "kaiming" (PEFT's default)
    seed: int = 0  # the adapters' initialisation draws (not a config key: the run's seed)

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def validate(self) -> None:
        bad = sorted(set(self.target_modules) - set(TARGETS))
        if bad:
            raise ValueError(f"model.lora.target_modules {bad} unknown; choose among {list(TARGETS)}")
        if self.a_init not in ("xavier", "kaiming"):
            raise ValueError(f"model.lora.lora_A_init_method={self.a_init!r}; use 'xavier' or 'kaiming'")

    def targets(self, module_name: str) -> bool:
        """Whether the linear layer named `module_name` (e.g. `decoder.layers.0.self_attention.linear_qkv`) gets an
        adapter: its last component is a target and no exclude entry matches (a suffix or a full component)."""
        last = module_name.rsplit(".", 1)[-1]
        if last not in self.target_modules:
            return False
        return not any(module_name == e or module_name.endswith("." + e) or f".{e}." in f".{module_name}."
                       for e in self.exclude_modules)


def _kind(module: nn.Module) -> Optional[str]:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if isinstance(module, ColumnParallelLinear):
        return COLUMN
    if isinstance(module, RowParallelLinear):
        return ROW
    return None


def _group_size(group: Any) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def _group_rank(group: Any) -> int:
    import torch.distributed as dist

    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


class LoRAAdapter(nn.Module):
    """The A and B factors of one tensor-parallel linear layer (this rank's shards; see the module docstring)."""

    def __init__(self, base: nn.Module, kind: str, settings: LoRASettings, name: str):
        super().__init__()
        self.kind, self.scaling, self.name = kind, settings.scaling, name  # name: the weight's canonical name
        self.tp_group = getattr(base, "tp_group", None)
        tp, rank = _group_size(self.tp_group), _group_rank(self.tp_group)
        self.explicit_expert_comm = bool(getattr(base, "explicit_expert_comm", False))
        if getattr(base, "gather_output", False):
            raise NotImplementedError(f"LoRA on {name}: a column-parallel layer with gather_output")
        self.sequence_parallel = bool(getattr(base, "sequence_parallel", False)) and not self.explicit_expert_comm
        self.tp_size = tp
        r, w = settings.rank, base.weight
        in_f, out_f = base.input_size, base.output_size
        # A is drawn whole from a generator seeded by the layer's name (the same on every TP rank and layout), then
        # sliced: replicated copies agree, and a layout change does not change the initial adapter.
        g = torch.Generator().manual_seed((settings.seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
        a_full = torch.empty(r, in_f, dtype=torch.float32)
        if settings.a_init == "xavier":
            nn.init.xavier_uniform_(a_full, generator=g)
        else:
            nn.init.kaiming_uniform_(a_full, a=math.sqrt(5), generator=g)
        if kind == COLUMN:
            a, b_shape = a_full, (out_f // tp, r)
        else:
            a, b_shape = a_full.chunk(tp, dim=1)[rank], (out_f, r)
        self.lora_A = nn.Parameter(a.to(device=w.device, dtype=w.dtype).contiguous())
        self.lora_B = nn.Parameter(torch.zeros(b_shape, device=w.device, dtype=w.dtype))
        self.dropout = nn.Dropout(settings.dropout) if settings.dropout > 0 else nn.Identity()
        self.enabled = True
        split, replicated = (self.lora_B, self.lora_A) if kind == COLUMN else (self.lora_A, self.lora_B)
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        set_tensor_model_parallel_attributes(split, True, 0 if kind == COLUMN else 1, 1)
        replicated.sequence_parallel = self.sequence_parallel  # grads partial over sequence shards: summed over TP
        for p in (self.lora_A, self.lora_B):  # experts reduce over the expert-data-parallel group
            p.allreduce = getattr(w, "allreduce", True)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings as mp

        a, b = self.lora_A, self.lora_B
        if self.explicit_expert_comm and self.tp_size > 1:
            # an expert under expert-TP: the MoE dispatcher gives every expert-TP rank the same tokens and sums the
            # ranks' partial outputs, so the adapter, like the base, needs no communication forward; its replicated
            # factor's gradient is a partial sum per rank, summed over expert-TP in backward (identity forward)
            if self.kind == COLUMN:
                a = mp.copy_to_tensor_model_parallel_region(a, group=self.tp_group)
            else:
                b = mp.copy_to_tensor_model_parallel_region(b, group=self.tp_group)
        h = F.linear(self.dropout(x), a)
        if self.kind == COLUMN:
            if self.sequence_parallel:
                h = mp.gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True, group=self.tp_group)
            elif not self.explicit_expert_comm and self.tp_size > 1:
                h = mp.copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        else:
            if self.sequence_parallel:
                h = mp.reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)
            elif not self.explicit_expert_comm and self.tp_size > 1:
                h = mp.reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        return F.linear(h, b) * self.scaling

    @torch.no_grad()
    def merged_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's shard of `W + scaling * B A` (a new tensor, in the weight's dtype; fp32 product)."""
        prod = self.lora_B.float() @ self.lora_A.float()
        return (weight.float() + self.scaling * prod).to(weight.dtype)

    def extra_repr(self) -> str:
        return f"{self.kind}, A {tuple(self.lora_A.shape)}, B {tuple(self.lora_B.shape)}, scaling {self.scaling:g}"


def _hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    adapter: LoRAAdapter = module.lora
    if not adapter.enabled:
        return output
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + adapter.delta(x).to(out.dtype), bias


def _sharded_state_dict(module: nn.Module, original: Any, prefix: str = "", sharded_offsets: tuple = (),
                        metadata: Optional[dict] = None) -> dict:
    """The linear's sharded state dict with the adapter's factors sharded like the base weight (megatron's own
    would call them replicated)."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    sd = original(prefix=prefix, sharded_offsets=sharded_offsets, metadata=metadata)
    ad: LoRAAdapter = module.lora
    axis = {"lora_B": 0} if ad.kind == COLUMN else {"lora_A": 1}
    if ad.explicit_expert_comm and ad.tp_size == 1:  # an expert without expert-TP: whole on its rank
        axis = {}
    tensors = {"lora_A": ad.lora_A, "lora_B": ad.lora_B}
    lora_sd = make_sharded_tensors_for_checkpoint(tensors, f"{prefix}lora.", axis, sharded_offsets,
                                                  tp_group=ad.tp_group,
                                                  dp_cp_group=(metadata or {}).get("dp_cp_group"))
    if ad.kind == COLUMN and ".linear_fc1." in f".{ad.name}" and getattr(module.config, "gated_linear_unit", False):
        # B's rows are the gate and up halves of this rank's shard ([gate_i; up_i]), as the fused weight's: saved as
        # two tensors, like megatron's MLP saves linear_fc1.weight, so a checkpoint loads at another (expert-)TP size
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

        key = f"{prefix}lora.lora_B"
        lora_sd[key] = apply_swiglu_sharded_factory(lora_sd[key], sharded_offsets,
                                                    (metadata or {}).get("singleton_local_shards", False))
    sd.update(lora_sd)
    return sd


def apply_lora(model_chunks: Sequence[nn.Module], settings: LoRASettings,
               trainable: Sequence[str] = ()) -> list[LoRAAdapter]:
    """Freeze every parameter of the (unwrapped) chunks, then attach an adapter to each targeted linear layer.
    `trainable`: module names kept trainable besides the adapters (a critic's `output_layer`). Each chunk gets
    `.megappo_lora` (the settings). Call before wrapping in DDP and building the optimizer."""
    from megatron.core import parallel_state as mpu

    from megappo.models.builder import unwrap
    from megappo.models.naming import canonical_name

    settings.validate()
    adapters = []
    for chunk in model_chunks:
        m = unwrap(chunk)
        m.requires_grad_(False)
        # adapters are seeded by their global name (layer and expert numbers of the whole model): the same initial
        # adapters at any pipeline / expert-parallel layout
        numbers = [layer.layer_number for layer in m.decoder.layers] if hasattr(m, "decoder") else []
        experts = getattr(m.config, "num_moe_experts", None) or 0
        ep = m.config.expert_model_parallel_size
        expert_offset = mpu.get_expert_model_parallel_rank() * (experts // ep) if experts and ep > 1 else 0
        for name in trainable:
            sub = getattr(m, name, None)
            if sub is not None:
                sub.requires_grad_(True)
        for name, module in list(m.named_modules()):
            if not settings.targets(name):
                continue
            kind = _kind(module)
            if kind is None:
                raise NotImplementedError(f"LoRA on {name}: {type(module).__name__} is not megatron's column/row-"
                                          "parallel linear (transformer-engine layers: build with the local spec)")
            if hasattr(module, "layer_norm_weight"):
                raise NotImplementedError(f"LoRA on {name}: transformer-engine's fused norm+linear; LoRA models "
                                          "use the local layer spec")
            module.lora = LoRAAdapter(module, kind, settings, canonical_name(f"{name}.weight", numbers, expert_offset))
            module.register_forward_hook(_hook, with_kwargs=True)
            module.sharded_state_dict = functools.partial(_sharded_state_dict, module, module.sharded_state_dict)
            adapters.append(module.lora)
        m.megappo_lora = settings
        m.megappo_checkpoint_keys = functools.partial(saved_key, m)
    if not adapters:
        raise ValueError(f"model.lora.target_modules {list(settings.target_modules)} (excluding "
                         f"{list(settings.exclude_modules)}) matched no linear layer")
    return adapters


@torch.no_grad()
def share_base(model_chunks: Sequence[nn.Module], base_chunks: Sequence[nn.Module],
               keep: Sequence[str] = ("output_layer",)) -> int:
    """Make the (unwrapped, adapter-less) chunks use `base_chunks`' parameters: each parameter whose name and shape
    match becomes the very same tensor (their own copies are released), except those under the `keep` modules (a
    critic's value head) and adapters. Both must be built from the same model in the same layout; a missing or
    mismatched parameter raises ValueError. Returns the number of parameters shared.

    `critic.model.lora.share_actor_base`: the critic's frozen base is the actor's (one copy of the base in memory).
    Shared parameters are frozen in both models, so megatron's DDP gives them no grad buffer and the optimizers never
    see them: neither role's step can change them."""
    from megappo.models.builder import unwrap

    if len(model_chunks) != len(base_chunks):
        raise ValueError(f"sharing a base: {len(model_chunks)} model chunks vs {len(base_chunks)} base chunks")
    n = 0
    for chunk, base_chunk in zip(model_chunks, base_chunks):
        m, base = unwrap(chunk), unwrap(base_chunk)
        theirs = {k: p for k, p in base.named_parameters() if not is_adapter_param(k)}
        for mod_name, module in m.named_modules():
            if any(mod_name == k or mod_name.startswith(k + ".") for k in keep):
                continue
            for p_name, p in list(module._parameters.items()):
                full = f"{mod_name}.{p_name}" if mod_name else p_name
                if p is None or is_adapter_param(full):
                    continue
                other = theirs.get(full)
                if other is None or other.shape != p.shape or other.dtype != p.dtype:
                    raise ValueError(f"sharing a base: {full} {tuple(p.shape)} has no equal in the base model "
                                     f"({None if other is None else tuple(other.shape)}); both must be the same "
                                     "model in the same parallel layout")
                if other.requires_grad:
                    raise ValueError(f"sharing a base: {full} is trainable in the base model (only a frozen LoRA "
                                     "base can be shared)")
                module._parameters[p_name] = other
                n += 1
    return n


def adapters(model_chunks: Sequence[nn.Module]) -> list[LoRAAdapter]:
    from megappo.models.builder import unwrap

    return [m for c in model_chunks for m in unwrap(c).modules() if isinstance(m, LoRAAdapter)]


def lora_settings(model_chunks: Sequence[nn.Module]) -> Optional[LoRASettings]:
    """The chunks' LoRA settings, None for a model without adapters."""
    from megappo.models.builder import unwrap

    return getattr(unwrap(model_chunks[0]), "megappo_lora", None) if model_chunks else None


@contextlib.contextmanager
def adapters_disabled(model_chunks: Sequence[nn.Module]) -> Iterator[None]:
    """The base model: every adapter off inside the block (the reference policy of a LoRA actor)."""
    ads = adapters(model_chunks)
    before = [a.enabled for a in ads]
    for a in ads:
        a.enabled = False
    try:
        yield
    finally:
        for a, e in zip(ads, before):
            a.enabled = e


def merged_weights(model: nn.Module) -> dict[int, torch.Tensor]:
    """id(base weight) -> this rank's merged shard, for every enabled adapter of the unwrapped `model`."""
    out = {}
    for module in model.modules():
        ad = getattr(module, "lora", None)
        if isinstance(ad, LoRAAdapter) and ad.enabled:
            out[id(module.weight)] = ad.merged_weight(module.weight)
    return out


def saved_key(model: nn.Module, key: str) -> bool:
    """Whether a LoRA model's checkpoint holds the sharded state-dict entry `key`: what the model trains (adapters, a
    critic's value head); its frozen base is the Hugging Face checkpoint it was built from."""
    head = model.output_layer.weight.requires_grad if getattr(model, "output_layer", None) is not None else False
    return ".lora." in key or (head and key.startswith("output_layer."))


def base_parameters(model: nn.Module, merged: bool = False) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) of the unwrapped `model` but its adapter factors; `merged`: an adapted layer's weight as
    its merged shard (a new tensor; its own weight where the adapter is off)."""
    weights = merged_weights(model) if merged else {}
    return [(n, weights.get(id(p), p)) for n, p in model.named_parameters() if not is_adapter_param(n)]


NO_ADAPTERS = "only_adapted: the model has no LoRA adapters"


def adapted_weight_filter(model_chunks: Sequence[nn.Module]) -> Callable[[str], bool]:
    """Whether a canonical weight name is one of the chunks' adapted layers' (ValueError: the model has none)."""
    settings = lora_settings(model_chunks)
    if settings is None:
        raise ValueError(NO_ADAPTERS)
    return functools.partial(is_lora_target_weight, settings=settings)


def is_adapter_param(name: str) -> bool:
    return ".lora.lora_A" in name or ".lora.lora_B" in name


def is_lora_target_weight(canonical: str, settings: LoRASettings) -> bool:
    """Whether the canonical megatron weight name `canonical` is the weight of an adapted layer."""
    if not canonical.endswith(".weight"):
        return False
    module = canonical[: -len(".weight")]
    return settings.targets(module)


def trainable_summary(model_chunks: Sequence[nn.Module]) -> tuple[int, int]:
    """(trainable parameters, all parameters) on this rank."""
    from megappo.models.builder import unwrap

    ps = [p for c in model_chunks for p in unwrap(c).parameters()]
    return sum(p.numel() for p in ps if p.requires_grad), sum(p.numel() for p in ps)
