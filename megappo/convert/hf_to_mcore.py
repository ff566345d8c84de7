"""Hugging Face -> megatron of the text families: stream HF safetensors into model chunks of any layout
(`load_gpt_weights`, which `megappo.kinds.weights.load_hf_weights` calls for a text model), and the writer of the
`megappo convert hf-to-mcore` command (`megappo.kinds.commands.hf_to_mcore`): `save_converted`.

Each rank reads only the rows/columns of its own shards (`safe_open(...).get_slice`), so no rank ever holds the full
model and no communication is needed except the final strict check. The command goes further: it builds the model
on the meta device and writes the checkpoint a bucket of tensors at a time (`stream_save`), so its memory is one
bucket plus the largest tensor, not the model.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from megappo.convert.hf_io import HFCheckpoint, copy_side_files, replace_dir, unique_staging_dir, write_error
from megappo.convert.mapping import (
    VALUE_HEAD, ConversionError, ModelSpec, ParamMap, expected_hf_shapes, model_spec_from_hf_config, param_maps,
    shard_from_hf,
)
from megappo.convert.params import LocalParam, check_all_used, local_params, model_role, not_a_parameter
from megappo.parallel import ParallelState

META_FILE = "megappo_convert.json"  # written next to a converted dist_checkpoint: role, layout, dtype, source


def _infer_role(model_chunks: list[nn.Module], ckpt: HFCheckpoint, role: Optional[str]) -> str:
    role = role or model_role(model_chunks)
    if role == "reward" and "score.weight" not in ckpt.files:
        raise ConversionError(
            f"{ckpt.path}: a reward model loads from a sequence-classification checkpoint with 'score.weight', which "
            f"this checkpoint lacks (architectures {ckpt.config.get('architectures')}); use role critic for a fresh "
            f"value head"
        )
    return role


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


def save_converted(chunks, materialiser, ckpt: HFCheckpoint, ps: ParallelState, role: str, out: str,
                   bucket_bytes: int, progress: bool, meta: dict) -> dict[str, int]:
    """Stream the (meta) `chunks`, each tensor read from `ckpt` as its bucket is written, into a staging folder that
    one rename publishes as `out` with the side files and `META_FILE`; collective. `materialiser`: the model kind's
    (`ModelKind.materialiser`). Returns save_streamed's stats."""
    from megappo.convert.stream_save import save_streamed
    from megappo.models.checkpoint import FORMAT_VERSION, model_sharded_state_dict, write_marker

    rank0 = ps.rank == 0
    multi = dist.get_world_size() > 1
    used: set[str] = set()
    materialise, by_id = materialiser(chunks, ckpt, ps, role, used)
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
        # command line ends every rank (see megappo.convert_cli._run). Rank 0 owns the staging folder and removes it.
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
