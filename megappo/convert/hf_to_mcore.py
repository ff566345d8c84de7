"""Hugging Face -> megatron: stream HF safetensors into model chunks of any layout (`load_hf_weights`, which the
trainer uses), and the `megappo convert hf-to-mcore` command that writes a megatron dist_checkpoint.

Each rank reads only the rows/columns of its own shards (`safe_open(...).get_slice`), so no rank ever holds the full
model and no communication is needed except the final strict check. The command goes further: it builds the model
on the meta device and writes the checkpoint a bucket of tensors at a time (`stream_save`), so its memory is one
bucket plus the largest tensor, not the model.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from megappo.convert.hf_io import (
    HFCheckpoint, check_output_dir, copy_side_files, replace_dir, unique_staging_dir, write_error,
)
from megappo.convert.mapping import (
    VALUE_HEAD, ConversionError, ModelSpec, ParamMap, expected_hf_shapes, model_spec_from_hf_config, param_maps,
    shard_from_hf,
)
from megappo.convert.params import LocalParam, check_all_used, local_params, model_role, not_a_parameter
from megappo.kinds import kind_of
from megappo.models.builder import unwrap
from megappo.parallel import ParallelState

META_FILE = "megappo_convert.json"  # written next to a converted dist_checkpoint: role, layout, dtype, source


# Conversion never trains: build the frozen twin of a role (same parameters and names), which also keeps megatron's
# training-only checks (MoE with TP > 1 needs sequence parallel) out of the way.
_FROZEN_TWIN = {"actor": "ref", "critic": "reward"}


def build_for_conversion(hf_dir_or_config: Any, role: str, parallel_state: ParallelState,
                         platform: Any) -> list[nn.Module]:
    """This rank's model chunks of `role` with uninitialised weights (every one is loaded next), in eval mode."""
    from megappo.models.builder import build_model

    chunks = build_model(hf_dir_or_config, _FROZEN_TWIN.get(role, role), parallel_state, platform,
                         config_overrides={"perform_initialization": False})
    for chunk in chunks:
        unwrap(chunk).megappo_role = role  # what the saved checkpoint records
    return chunks


def _infer_role(model_chunks: list[nn.Module], ckpt: HFCheckpoint, role: Optional[str]) -> str:
    role = role or model_role(model_chunks)
    if role == "reward" and "score.weight" not in ckpt.files:
        raise ConversionError(
            f"{ckpt.path}: a reward model loads from a sequence-classification checkpoint with 'score.weight', which "
            f"this checkpoint lacks (architectures {ckpt.config.get('architectures')}); use role critic for a fresh "
            f"value head"
        )
    return role


@torch.no_grad()
def load_hf_weights(model_chunks: list[nn.Module], hf_dir: Union[str, HFCheckpoint], parallel_state: ParallelState, *,
                    strict: bool = True, role: Optional[str] = None, world_group: Any = None,
                    progress: bool = False) -> dict[str, int]:
    """Copy a HF checkpoint into this rank's `model_chunks` (any TP/PP/VPP/EP layout); return {tensors, bytes}.

    role: None reads the chunks' `megappo_role`. critic: from a causal LM the value head keeps its fresh
    initialisation and the LM head is ignored (from a sequence-classification checkpoint it takes `score.weight`);
    reward: `score.weight` -> the value head. strict: every megatron parameter on every rank was
    loaded and every HF tensor was used by some rank (checked with one all_gather_object over `world_group`,
    default the whole world); an unused tensor means the config and the weights disagree.
    """
    ckpt = hf_dir if isinstance(hf_dir, HFCheckpoint) else HFCheckpoint.open(hf_dir)
    return kind_of(ckpt.config).load_hf_weights(model_chunks, ckpt, parallel_state, strict=strict, role=role,
                                                world_group=world_group, progress=progress)


def gpt_model_spec(hf_config: Any, source: Optional[str] = None) -> ModelSpec:
    """The conversion's ModelSpec of a text model (`source`: the config's path, for error messages)."""
    return model_spec_from_hf_config(hf_config, source)


@torch.no_grad()
def load_gpt_weights(model_chunks: list[nn.Module], ckpt: HFCheckpoint, parallel_state: ParallelState, *,
                     strict: bool = True, role: Optional[str] = None, world_group: Any = None,
                     progress: bool = False) -> dict[str, int]:
    """`load_hf_weights` of the text families (an open HFCheckpoint)."""
    spec = gpt_model_spec(ckpt.config, os.path.join(ckpt.path, "config.json"))
    role = _infer_role(model_chunks, ckpt, role)
    maps = {pm.mcore: pm for pm in param_maps(spec, role)}
    used: set[str] = set()
    n_tensors = n_bytes = 0
    todo = local_params(model_chunks, spec, parallel_state, maps)
    if progress:
        from tqdm import tqdm

        todo = tqdm(todo, desc="hf-to-mcore", unit=" tensors")
    for lp in todo:
        shard = _hf_shard(lp, maps[lp.canonical], spec, ckpt, role)
        if shard is None:
            continue
        lp.param.data.copy_(shard)
        used.update(maps[lp.canonical].hf)
        n_tensors += 1
        n_bytes += shard.numel() * shard.element_size()
    if strict:
        check_all_used(ckpt, used, role, world_group)
    ckpt.close()
    return {"tensors": n_tensors, "bytes": n_bytes}


def _hf_shard(lp: LocalParam, pm: ParamMap, spec: ModelSpec, ckpt: HFCheckpoint, role: str) -> Optional[torch.Tensor]:
    """This rank's shard of `lp` read from `ckpt` (None: a critic's fresh value head, which keeps its init)."""
    if lp.canonical == VALUE_HEAD and role == "critic" and "score.weight" not in ckpt.files:
        return None  # a causal LM has nothing to put there
    for name, shape in expected_hf_shapes(pm, spec, tuple(lp.param.shape), lp.tp_size).items():
        ckpt.require(name, f"megatron {lp.canonical}")
        if ckpt.shapes[name] != shape:
            raise ConversionError(
                f"{os.path.join(ckpt.path, ckpt.files[name])}: tensor {name!r} has shape {ckpt.shapes[name]} but "
                f"config.json implies {shape} (megatron {lp.canonical}); the weights do not match the config"
            )
    return shard_from_hf(pm, spec, ckpt.read, lp.tp_rank, lp.tp_size, tuple(lp.param.shape))


# -- the command ---------------------------------------------------------------------------------------------------
def hf_to_mcore(hf_dir: str, out_dir: str, *, tp: int = 1, pp: int = 1, ep: int = 1, etp: Optional[int] = None,
                vpp: Optional[int] = None, dtype: Optional[str] = None, role: str = "actor", force: bool = False,
                progress: bool = True, bucket_bytes: int = 512 << 20) -> dict[str, Any]:
    """Convert `hf_dir` into a megatron dist_checkpoint at `out_dir` on the ranks of the current launch.

    Run in one process for tp*pp*ep == 1, else under torchrun with tp*pp*(dp) ranks. Memory per rank stays near
    `bucket_bytes` plus the largest tensor: the model is built on the meta device and written a bucket at a time
    (`megappo.convert.stream_save`). Returns a summary dict.
    """
    from megappo.platform.layout import ParallelLayout
    from megappo.parallel import init_parallel
    from megappo.platform import detect_platform

    t0 = time.time()
    out = check_output_dir(out_dir, {"--hf": hf_dir}, force)  # before anything is read or built
    ckpt = HFCheckpoint.open(hf_dir)  # validates config, index and every shard before any rank builds anything
    kind = kind_of(ckpt.config)
    spec = kind.language_model_spec(ckpt.config, os.path.join(hf_dir, "config.json"))  # sizes init_parallel checks
    if role == "reward" and "score.weight" not in ckpt.files:
        raise ConversionError(f"{hf_dir}: --role reward needs a sequence-classification checkpoint (score.weight)")
    platform = detect_platform(dtype=dtype or _checkpoint_dtype(ckpt))
    layout = ParallelLayout(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp)
    ps = init_parallel(layout, platform, seed=0, num_attention_heads=spec.num_heads,
                       num_key_value_heads=spec.num_kv_heads, num_layers=spec.num_layers,
                       num_experts=spec.num_experts or None)
    # Built on the meta device: no weight exists until its bucket is written (see stream_save); megatron's random
    # init is skipped. The critic's fresh value head is real (ValueHead initialises it on the CPU).
    with torch.device("meta"):
        chunks = build_for_conversion(hf_dir, role, ps, platform)
    meta = dict(role=role, source=os.path.abspath(hf_dir), dtype=str(platform.dtype).replace("torch.", ""),
                layout=dict(tp=tp, pp=pp, ep=ep, etp=etp, vpp=vpp), family=ckpt.config["model_type"])
    t_save = time.time()
    stats = _save(chunks, kind, ckpt, ps, role, out, bucket_bytes, progress, meta)
    ckpt.close()
    total = torch.tensor([stats["bytes"]], dtype=torch.float64, device=platform.device)  # NCCL: on the GPU
    if dist.get_world_size() > 1:
        dist.all_reduce(total)
    seconds = time.time() - t0
    summary = dict(tensors=stats["tensors"], bytes=int(total.item()), seconds=seconds, buckets=stats["buckets"],
                   save_seconds=time.time() - t_save, out=out)
    if ps.rank == 0 and progress:
        print(f"hf-to-mcore: {stats['tensors']} tensors on rank 0, {summary['bytes'] / 1e9:.3f} GB over all ranks "
              f"(tp{tp} pp{pp} ep{ep}) in {seconds:.1f} s ({summary['bytes'] / 1e9 / max(seconds, 1e-9):.3f} GB/s; "
              f"{stats['buckets']} buckets) -> {out}", flush=True)
    return summary


def _save(chunks, kind, ckpt: HFCheckpoint, ps: ParallelState, role: str, out: str, bucket_bytes: int,
          progress: bool, meta: dict) -> dict[str, int]:
    """Stream the (meta) `chunks`, each tensor read from `ckpt` as its bucket is written, into a staging folder that
    one rename publishes as `out` with the side files and `META_FILE`; collective. Returns save_streamed's stats."""
    from megappo.convert.stream_save import save_streamed
    from megappo.models.checkpoint import FORMAT_VERSION, model_sharded_state_dict, write_marker

    rank0 = ps.rank == 0
    multi = dist.get_world_size() > 1
    used: set[str] = set()
    materialise, by_id = kind.materialiser(chunks, ckpt, ps, role, used)
    bar = None
    if progress and rank0:
        from tqdm import tqdm

        bar = tqdm(total=len(by_id), desc="hf-to-mcore", unit=" tensors")
    # save_streamed writes into an empty folder; the side files join it before one rename publishes `out`. The
    # folder's name is rank 0's, unique to this run: concurrent conversions never share one.
    tmp = [unique_staging_dir(out)]
    if multi:
        dist.broadcast_object_list(tmp, src=0)
    tmp = tmp[0]
    try:
        if rank0:
            os.makedirs(tmp)
        if multi:
            dist.barrier()
        stats = save_streamed(model_sharded_state_dict(chunks), tmp, materialise, bucket_bytes=bucket_bytes,
                              content_metadata={"megappo_format": FORMAT_VERSION},
                              progress=bar.update if bar is not None else None)
        if bar is not None:
            bar.close()
        check_all_used(ckpt, used, role, None)
        if rank0:
            write_marker(tmp, chunks, has_optimizer=False)
            copy_side_files(meta["source"], tmp)
            with open(os.path.join(tmp, META_FILE), "w") as f:
                json.dump(meta, f, indent=2)
            replace_dir(tmp, out)
        if multi:
            dist.barrier()  # no rank returns before `out` is published
    except BaseException as e:  # torch's CheckpointException is no Exception; Ctrl-C cleans up too
        # No barrier on this path: the other ranks may have failed too, or wait in a collective this rank left; the
        # command line ends every rank (see cli._run). Rank 0 owns the staging folder and removes it.
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
        err = write_error(e, out) if not isinstance(e, KeyboardInterrupt) else None
        if err is not None:
            raise err from e
        raise
    return stats


def gpt_materialiser(chunks, ckpt: HFCheckpoint, ps: ParallelState, role: str, used: set[str]):
    """(materialise(meta param) -> its shard read from `ckpt`, {id(param): LocalParam}); `used` collects HF names."""
    spec = gpt_model_spec(ckpt.config, os.path.join(ckpt.path, "config.json"))
    maps = {pm.mcore: pm for pm in param_maps(spec, role)}
    by_id = {id(lp.param): lp for lp in local_params(chunks, spec, ps, maps)}

    def materialise(t: torch.Tensor) -> torch.Tensor:
        lp = by_id.get(id(t))
        if lp is None:
            raise not_a_parameter(tuple(t.shape), spec.family)
        shard = _hf_shard(lp, maps[lp.canonical], spec, ckpt, role)
        if shard is None:
            return t  # the fresh value head
        used.update(maps[lp.canonical].hf)
        return shard

    return materialise, by_id


def _checkpoint_dtype(ckpt: HFCheckpoint) -> str:
    """The dtype of the checkpoint's weights (config's `torch_dtype`/`dtype`, else the first tensor's)."""
    name = ckpt.config.get("dtype") or ckpt.config.get("torch_dtype")
    if name:
        return str(name)
    first = next(iter(ckpt.dtypes.values()), torch.float32)
    return str(first).replace("torch.", "")
