"""LoRA adapters <-> Hugging Face: merged exports and PEFT adapter directories (`megappo.models.lora`).

- `megappo.kinds.commands.lora_to_hf(ckpt, out, lora_only=False)`: `megappo convert mcore-to-hf --merge-lora` (a
  complete HF model with `W + alpha/r * B A` in every adapted layer) or `--lora-only` (a PEFT directory:
  `adapter_config.json` and `adapter_model.safetensors`, which `peft.PeftModel.from_pretrained(base, dir)` loads
  onto the base). The checkpoint is a LoRA role's trainer checkpoint (`global_step_N/actor`): adapters only, with
  `lora_base.json` naming the base model, its checksum and the adapter shape.
- `load_peft_adapter(chunks, dir, ps, hf_config)`: the reverse, `model.lora.adapter_path`.

PEFT names adapters per HF linear layer; megatron fuses q/k/v (`linear_qkv`) and gate/up (`linear_fc1`). A fused
layer's B is split as the conversion code splits the fused weight (`mapping.merge_to_hf`: per query group, gate/up
halves), and its A, shared by the parts, is written once per part: q_proj, k_proj and v_proj carry the same A.
Reading back takes the first part's A (they are equal when megappo wrote them).
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from megappo.convert.mapping import ConversionError, ParamMap, merge_to_hf, model_spec_from_hf_config, param_maps

PEFT_PREFIX = "base_model.model."


def _adapted(model_chunks: list[nn.Module]) -> list[tuple[str, Any]]:
    """(canonical weight name, adapter) of this rank's adapted layers (global layer and expert numbers)."""
    from megappo.models.lora import adapters

    return [(ad.name, ad) for ad in adapters(model_chunks)]


def _gather(t: torch.Tensor, group: Any) -> list[torch.Tensor]:
    n = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    if n == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _peft_key(hf_weight: str, factor: str) -> str:
    return f"{PEFT_PREFIX}{hf_weight[: -len('.weight')]}.{factor}.weight"


@torch.no_grad()
def peft_state_dict(model_chunks: list[nn.Module], ps: Any, hf_config: Any,
                    dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """The adapters as PEFT names them (full tensors, every rank), at any TP/PP/EP layout: B or A is gathered over
    TP here; the pipeline stages' layers and the expert-parallel ranks' experts are then exchanged between all ranks
    (adapters are small: rank r times the layer widths)."""
    spec = model_spec_from_hf_config(hf_config)
    maps = {pm.mcore: pm for pm in param_maps(spec, "actor")}
    out: dict[str, torch.Tensor] = {}
    expert_keys: set[str] = set()
    for canonical, ad in _adapted(model_chunks):
        pm: ParamMap = maps[canonical]
        group = ps.expert_tp_group if pm.expert else ps.tp_group
        if pm.expert:
            expert_keys.update(_peft_key(h, f) for h in pm.hf for f in ("lora_A", "lora_B"))
        a, b = ad.lora_A.detach(), ad.lora_B.detach()
        if ad.kind == "column":  # B split like the weight's rows; A replicated and shared by the fused parts
            parts = merge_to_hf(pm, spec, _gather(b, group))
            for hf_name, b_part in parts:
                out[_peft_key(hf_name, "lora_A")] = a.clone()
                out[_peft_key(hf_name, "lora_B")] = b_part.clone()
        else:  # A split like the weight's columns; B replicated
            ((hf_name, a_full),) = merge_to_hf(pm, spec, _gather(a, group))
            out[_peft_key(hf_name, "lora_A")] = a_full.clone()
            out[_peft_key(hf_name, "lora_B")] = b.clone()
    if dtype is not None:
        out = {k: v.to(dtype) for k, v in out.items()}
    if (ps.pp_size > 1 or ps.ep_size > 1) and dist.is_initialized():
        out = _exchange(out, expert_keys, ps)
    return {k: v.contiguous() for k, v in out.items()}


def _exchange(mine: dict[str, torch.Tensor], expert_keys: set[str], ps: Any) -> dict[str, torch.Tensor]:
    """Every rank's tensors on every rank. Only the first rank of each (expert-)TP group sends a tensor (its TP
    ranks hold the same gathered one); data-parallel replicas send equal tensors under the same names, kept once."""
    send = {k: v.cpu() for k, v in mine.items() if (ps.etp_rank if k in expert_keys else ps.tp_rank) == 0}
    everyone: list[Optional[dict]] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, send)
    out: dict[str, torch.Tensor] = {}
    for part in everyone:
        for k, v in (part or {}).items():
            out.setdefault(k, v)
    return out


def adapter_config(tensors: dict[str, torch.Tensor], rank: int, alpha: float, base: str,
                   all_layers: bool) -> dict:
    """PEFT's adapter_config.json for `tensors`: short target names when every layer of those kinds is adapted,
    else a regex of the exact modules (exclude_modules)."""
    modules = sorted({k[len(PEFT_PREFIX):].rsplit(".lora_", 1)[0] for k in tensors})
    short = sorted({m.rsplit(".", 1)[-1] for m in modules})
    targets: Any = short if all_layers else "^(" + "|".join(re.escape(m) for m in modules) + ")$"
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
            "target_modules": targets, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
            "init_lora_weights": True, "modules_to_save": None, "base_model_name_or_path": base,
            "inference_mode": True}


def write_peft_dir(tensors: dict[str, torch.Tensor], config: dict, out_dir: str) -> str:
    from safetensors.torch import save_file

    from megappo.platform.files import as_if_created

    os.makedirs(out_dir, exist_ok=True)
    weights = os.path.join(out_dir, "adapter_model.safetensors")
    save_file({k: v.cpu() for k, v in tensors.items()}, weights, metadata={"format": "pt"})
    as_if_created(weights)  # as adapter_config.json beside it
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return out_dir


@torch.no_grad()
def load_peft_adapter(model_chunks: list[nn.Module], adapter_dir: str, ps: Any, hf_config: Any) -> int:
    """Set the chunks' adapters from a PEFT directory (as `write_peft_dir` writes, or PEFT saves for the same
    layers). Returns the number of adapters set; a layer the directory lacks raises ConversionError."""
    from safetensors.torch import load_file

    from megappo.convert.mapping import shard_from_hf

    path = os.path.join(adapter_dir, "adapter_model.safetensors")
    if not os.path.isfile(path):
        raise ConversionError(f"{path}: missing; model.lora.adapter_path must be a PEFT adapter directory")
    saved = load_file(path)
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        cfg = json.load(f)
    spec = model_spec_from_hf_config(hf_config)
    maps = {pm.mcore: pm for pm in param_maps(spec, "actor")}
    n = 0
    for canonical, ad in _adapted(model_chunks):
        if abs(cfg["lora_alpha"] / cfg["r"] - ad.scaling) > 1e-9 or cfg["r"] != ad.lora_A.shape[0]:
            raise ConversionError(f"{adapter_dir}: r={cfg['r']} lora_alpha={cfg['lora_alpha']} differ from "
                                  f"model.lora (rank {ad.lora_A.shape[0]}, alpha/rank {ad.scaling:g})")
        pm = maps[canonical]
        tp_rank, tp_size = (ps.etp_rank, ps.etp_size) if pm.expert else (ps.tp_rank, ps.tp_size)

        def read(factor):
            def reader(name, dim, start, stop):
                key = _peft_key(name, factor)
                if key not in saved:
                    raise ConversionError(f"{path} lacks {key}")
                t = saved[key]
                return t if dim is None else t.narrow(dim, start, stop - start)
            return reader

        if ad.kind == "column":
            ad.lora_A.copy_(saved[_peft_key(pm.hf[0], "lora_A")])
            ad.lora_B.copy_(shard_from_hf(pm, spec, read("lora_B"), tp_rank, tp_size, tuple(ad.lora_B.shape)))
        else:
            ad.lora_A.copy_(shard_from_hf(pm, spec, read("lora_A"), tp_rank, tp_size, tuple(ad.lora_A.shape)))
            ad.lora_B.copy_(saved[_peft_key(pm.hf[0], "lora_B")])
        n += 1
    return n


def write_sync_adapter(model_chunks: list[nn.Module], ps: Any, hf_config: Any, out_dir: str, lora: Any, base: str,
                       dtype: torch.dtype) -> tuple[str, int]:
    """rollout.lora_sync=adapter: the actor's adapters (`lora`: its model.lora config) as a PEFT directory that
    SGLang loads (`/load_lora_adapter`); rank 0 writes it, every rank takes part. Returns (out_dir, bytes)."""
    tensors = peft_state_dict(model_chunks, ps, hf_config, dtype=dtype)
    if not dist.is_initialized() or dist.get_rank() == 0:
        write_peft_dir(tensors, adapter_config(tensors, lora.rank, lora.alpha, base,
                                               all_layers=not lora.exclude_modules), out_dir)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    return out_dir, sum(t.numel() * t.element_size() for t in tensors.values())


def read_lora_base(ckpt_dir: str) -> dict:
    from megappo.models.lora import LORA_BASE_FILE, read_lora_base as read_record

    record = read_record(ckpt_dir)
    if record is None:
        raise ConversionError(f"{os.path.join(ckpt_dir, LORA_BASE_FILE)}: missing; --merge-lora / --lora-only need "
                              "a LoRA role's trainer checkpoint (global_step_N/actor of a run with model.lora.rank > 0)")
    return record


def write_lora_export(chunks: list[nn.Module], ps: Any, hf_config: dict, merged: Any, lora: dict, base: str,
                      out_dir: str, *, lora_only: bool, dtype: torch.dtype, force: bool, max_shard_bytes: int,
                      progress: bool) -> None:
    """Write `lora_to_hf`'s output from the loaded LoRA `chunks`: the PEFT adapter directory (`lora_only`), else the
    merged model, `merged` ((HF name, tensor) pairs of the model's kind, only drawn here); collective."""
    from megappo.convert.mcore_to_hf import output_config, write_hf_dir

    rank0 = ps.rank == 0
    if lora_only:
        tensors = peft_state_dict(chunks, ps, hf_config, dtype=dtype)
        if rank0:
            write_peft_dir(tensors, adapter_config(tensors, lora["rank"], lora["alpha"], base,
                                                   all_layers=not lora["exclude_modules"]), out_dir)
            if progress:
                print(f"mcore-to-hf --lora-only: {len(tensors)} adapter tensors -> {out_dir}", flush=True)
    else:
        write_hf_dir(merged, base, out_dir, rank0, force, max_shard_bytes, progress,
                     output_config(hf_config, "actor", dtype))
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
