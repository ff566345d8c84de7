"""Stream HF tensors straight out of a megatron dist_checkpoint (torch_dist format), one parameter at a time.

megatron saves every parameter under a layout-independent *global* tensor: decoder layers stacked on a leading axis
(`decoder.layers.self_attention.linear_qkv.weight` [L, G*(q+2)*d, H]), experts on a second one
(`decoder.layers.mlp.experts.experts.linear_fc1.weight` [L, E, 2F, H]), fused tensors in their TP-1 order (qkv
interleaved per group, fc1 = [gate; up]) and the embedding with its padded rows. So the slice [layer i (, expert e)]
of a global tensor is exactly the TP-1 megatron parameter, and `mapping.merge_to_hf` turns it into HF tensors: the
same conversion `kinds.weights.iter_hf_weights` applies to a live model after its gathers.

Reads go through torch.distributed.checkpoint with a planner that asks for one [1, ...] slice, so peak memory is one
parameter (plus the stored chunk it is cut from), whatever the model size; no model is built.
"""
from __future__ import annotations

import re
from typing import Any, Iterator, Optional

import torch

from megappo.convert.mapping import ConversionError, ModelSpec, merge_to_hf, model_spec_from_hf_config, param_maps

# local-spec names that megatron's sharded_state_dict stores under their transformer-engine names
_CKPT_ALIASES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")


def checkpoint_key(canonical: str) -> tuple[list[str], tuple[int, ...]]:
    """Candidate dist_checkpoint keys of a canonical parameter name, and the leading indices to slice."""
    m = _LAYER_RE.match(canonical)
    if not m:
        return [canonical], ()
    layer, rest = int(m.group(1)), m.group(2)
    if (x := _EXPERT_RE.match(rest)) is not None:
        return [f"decoder.layers.mlp.experts.experts.{x.group(2)}"], (layer, int(x.group(1)))
    keys = [f"decoder.layers.{rest}"]
    if rest in _CKPT_ALIASES:
        keys.insert(0, f"decoder.layers.{_CKPT_ALIASES[rest]}")
    return keys, (layer,)


class DistCheckpointReader:
    """Read [layer (, expert)] slices of a megatron dist_checkpoint's global tensors without a model.

    `read(canonical)` returns the TP-1 megatron parameter of that canonical name.
    """

    def __init__(self, path: str):
        from megappo.models.safe_pickle import safe_filesystem_reader

        self.path = path
        # torch re-reads `.metadata` on every dcp.load: each read goes through the allow-list unpickler
        self._reader = safe_filesystem_reader(path)
        self.metadata = self._reader.read_metadata()
        self._tensors = {k: v for k, v in self.metadata.state_dict_metadata.items() if hasattr(v, "chunks")}

    def read(self, canonical: str, prefix: str = "") -> torch.Tensor:
        """prefix: of the GPTModel's names in the checkpoint (`language_model.` in a vision-language model)."""
        import torch.distributed.checkpoint as dcp

        keys, index = checkpoint_key(canonical[len(prefix):])
        keys = [prefix + k for k in keys]
        key = next((k for k in keys if k in self._tensors), None)
        if key is None:
            raise ConversionError(
                f"{self.path}: the megatron checkpoint has no tensor {' or '.join(keys)} (for {canonical}); it was "
                f"saved from a different model or megatron version"
            )
        md = self._tensors[key]
        if len(index) > len(md.size) or any(i >= n for i, n in zip(index, md.size)):
            raise ConversionError(f"{self.path}: tensor {key} has shape {tuple(md.size)}; no slice {index} "
                                  f"(for {canonical}): the checkpoint does not match config.json")
        shape = (1,) * len(index) + tuple(md.size[len(index):])
        buf = torch.empty(shape, dtype=md.properties.dtype)
        offsets = tuple(index) + (0,) * (len(md.size) - len(index))
        dcp.load({key: buf}, storage_reader=self._reader, planner=_SlicePlanner({key: offsets}), no_dist=True)
        return buf.reshape(md.size[len(index):])


def _slice_planner_cls():
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class SlicePlanner(DefaultLoadPlanner):
        """Load each state-dict tensor as the chunk of its global tensor that starts at `offsets[key]`."""

        def __init__(self, offsets: dict[str, tuple[int, ...]]):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self._offsets = offsets

        def create_local_plan(self) -> LoadPlan:
            items = []
            for fqn, t in self.state_dict.items():
                chunk = ChunkStorageMetadata(offsets=torch.Size(self._offsets[fqn]), sizes=t.size())
                items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], [chunk])
            self.plan = LoadPlan(items)
            return self.plan

        def lookup_tensor(self, index):  # our plain tensor *is* the chunk at index.offset
            return self.state_dict[index.fqn]

    return SlicePlanner


def _SlicePlanner(offsets: dict[str, tuple[int, ...]]):  # noqa: N802 - a class built lazily (torch import)
    return _slice_planner_cls()(offsets)


def iter_hf_weights_from_checkpoint(mcore_dir: str, spec: ModelSpec, role: str, *,
                                    dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, tensor) for every HF tensor of the model saved in `mcore_dir`, one parameter at a time."""
    reader = DistCheckpointReader(mcore_dir)
    for pm in param_maps(spec, role):
        for name, t in merge_to_hf(pm, spec, [reader.read(pm.mcore)]):
            yield name, (t.to(dtype) if dtype is not None else t)


def iter_gpt_weights_from_checkpoint(mcore_dir: str, hf_config: Any, role: str, *,
                                     dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """`iter_hf_weights_from_checkpoint` of a text model described by its HF config."""
    return iter_hf_weights_from_checkpoint(mcore_dir, model_spec_from_hf_config(hf_config), role, dtype=dtype)


def checkpoint_dtype(mcore_dir: str) -> Optional[torch.dtype]:
    """The dtype of the embedding as saved (the checkpoint's parameter dtype)."""
    reader = DistCheckpointReader(mcore_dir)
    md = reader._tensors.get("embedding.word_embeddings.weight",
                             reader._tensors.get("language_model.embedding.word_embeddings.weight"))  # VLM
    return md.properties.dtype if md is not None else None
