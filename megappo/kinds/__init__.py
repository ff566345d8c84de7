"""Model kinds: how each kind of Hugging Face model is built, loaded, exported, verified and fed, chosen once from
its `config.json`'s `model_type` (`kind_of`). The trainer, the conversion code and the engines ask the kind; none of
them asks which model it has.

    kind = kind_of(hf_dir_or_config)       # a ModelKind: `gpt` for the text families, `qwen2_vl` for Qwen2/2.5-VL
    kind.multi_modal, kind.hf_auto_class   # plain answers, no import
    kind.build(...), kind.load_hf_weights(...), kind.iter_hf_weights(...), kind.verify(...)   # imported when asked

Light to import (no torch): the table names each kind's implementations as "module:function" strings, imported when
called, so the preflight checks and the SGLang launcher can ask a model directory's kind before torch loads.

Adding a kind is one folder (`megappo/kinds/<name>/`, its model, conversion and verification) and one entry in
`KINDS`.
"""
from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional


def _implementation(what: str) -> Callable[..., Any]:
    """A `ModelKind` method that calls the kind's implementation of `what` (its "module:function", imported then)."""

    def call(self: "ModelKind", *args: Any, **kw: Any) -> Any:
        return self._call(what)(*args, **kw)

    call.__name__ = call.__qualname__ = what
    return call


@dataclass(frozen=True)
class ModelKind:
    """One kind of model. Each `impl` value is "module:function"; the methods below call them.

    build(hf_dir_or_config, role, parallel_state, platform, **kw) -> this rank's model chunks
    load_hf_weights(chunks, ckpt: HFCheckpoint, parallel_state, *, strict, role, world_group, progress) -> counts
    iter_hf_weights(chunks, parallel_state, hf_config, **kw) -> buckets of (HF name, full tensor); collective
    iter_hf_weights_from_checkpoint(mcore_dir, hf_config, role, *, dtype) -> (HF name, tensor), no model built
    materialiser(chunks, ckpt, parallel_state, role, used) -> (materialise(meta param) -> shard, {id(param): ...})
    language_model_spec(hf_config, role) -> the conversion's ModelSpec of the (language) model
    verify(hf_dir, chunks, parallel_state, hf_config, **kw) -> {max_abs_diff, atol, ok, ...}; collective
    image_token_id(hf_dir_or_config) -> the image placeholder's token id (multi-modal kinds)
    preflight(cfg, engine_takes_images) -> the run config's settings this kind does not support, as error messages
    image_processing(model_dir, tokenizer, *, min_pixels, max_pixels) -> the data loader's `ImageProcessing`
        (multi-modal kinds; None for the others)
    position_ids(input_ids, image_grid_thw, image_token_id, spatial_merge_size, attention_mask=None,
        image_mask=None) -> a multi-modal kind's rotary positions of a batch with images
    """

    name: str
    model_types: tuple[str, ...]  # config.json model_type values of this kind (empty: every other one)
    multi_modal: bool  # prompts carry images (engines feed them, batches keep them per row)
    hf_auto_class: str  # the transformers auto class that loads a causal LM of this kind
    impl: Mapping[str, str] = field(default_factory=dict)

    def _call(self, what: str) -> Callable[..., Any]:
        target = self.impl.get(what)
        if target is None:
            raise NotImplementedError(f"model kind {self.name!r} has no {what}")
        module, function = target.split(":")
        return getattr(importlib.import_module(module), function)

    build = _implementation("build")
    load_hf_weights = _implementation("load_hf_weights")
    iter_hf_weights = _implementation("iter_hf_weights")
    iter_hf_weights_from_checkpoint = _implementation("iter_hf_weights_from_checkpoint")
    materialiser = _implementation("materialiser")
    language_model_spec = _implementation("language_model_spec")
    verify = _implementation("verify")
    position_ids = _implementation("position_ids")

    def image_token_id(self, hf_dir_or_config: Any) -> Optional[int]:
        return self._optional("image_token_id", hf_dir_or_config)

    def image_processing(self, model_dir: str, tokenizer: Any, **kw: Any) -> Any:
        return self._optional("image_processing", model_dir, tokenizer, **kw)

    def preflight(self, cfg: Any, engine_takes_images: bool = True) -> list[str]:
        """What this kind refuses in a run's config, one error per setting (none: no rules of its own).
        engine_takes_images: whether the run's rollout engine feeds the prompts' images."""
        return self._optional("preflight", cfg, engine_takes_images) or []

    def _optional(self, what: str, *args: Any, **kw: Any) -> Any:
        """What an implementation this kind may lack answers (None when it has none)."""
        return self._call(what)(*args, **kw) if what in self.impl else None


_CONVERT = "megappo.convert"
_VL = "megappo.kinds.qwen2_vl"
QWEN2_VL = ModelKind("qwen2_vl", ("qwen2_5_vl", "qwen2_vl"), multi_modal=True,
                     hf_auto_class="AutoModelForImageTextToText", impl={
                         "build": f"{_VL}.model:build_vlm_model",
                         "load_hf_weights": f"{_VL}.convert:load_hf_vlm_weights",
                         "iter_hf_weights": f"{_VL}.convert:iter_hf_vlm_weights",
                         "iter_hf_weights_from_checkpoint": f"{_VL}.convert:iter_hf_vlm_weights_from_checkpoint",
                         "materialiser": f"{_VL}.convert:vlm_materialiser",
                         "language_model_spec": f"{_VL}.convert:language_model_spec",
                         "verify": f"{_VL}.verify:verify_vlm",
                         "image_token_id": f"{_VL}.config:image_token_id",
                         "preflight": f"{_VL}.preflight:preflight",
                         "image_processing": f"{_VL}.images:image_processing",
                         "position_ids": f"{_VL}.rope_index:mrope_position_ids",
                     })
# the text families (llama, qwen2, qwen3, their MoE variants, mixtral): megatron-core's GPTModel
GPT = ModelKind("gpt", (), multi_modal=False, hf_auto_class="AutoModelForCausalLM", impl={
    "build": "megappo.models.builder:build_gpt_model",
    "load_hf_weights": f"{_CONVERT}.hf_to_mcore:load_gpt_weights",
    "iter_hf_weights": f"{_CONVERT}.export:iter_gpt_weights",
    "iter_hf_weights_from_checkpoint": f"{_CONVERT}.dist_reader:iter_gpt_weights_from_checkpoint",
    "materialiser": f"{_CONVERT}.hf_to_mcore:gpt_materialiser",
    "language_model_spec": f"{_CONVERT}.hf_to_mcore:gpt_model_spec",
    "verify": f"{_CONVERT}.verify:verify_gpt",
})
KINDS: tuple[ModelKind, ...] = (QWEN2_VL, GPT)
_BY_TYPE = {t: kind for kind in KINDS for t in kind.model_types}


def model_type(hf_dir_or_config: Any) -> Optional[str]:
    """`model_type` of a model directory (its config.json), a config.json path, a dict or a PretrainedConfig; None
    when there is none to read (no path, no readable config, no model_type in it)."""
    if isinstance(hf_dir_or_config, Mapping):
        return hf_dir_or_config.get("model_type")
    if isinstance(hf_dir_or_config, (str, os.PathLike)) and hf_dir_or_config:
        path = os.path.expanduser(os.fspath(hf_dir_or_config))
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f).get("model_type")
        except (OSError, ValueError, AttributeError):
            return None
    return getattr(hf_dir_or_config, "model_type", None)


def kind_of(hf_dir_or_config: Any) -> ModelKind:
    """The kind of a model directory, config.json path, config dict or PretrainedConfig: the `gpt` kind for every
    model type no other kind claims (and for a config that cannot be read: the gpt builder and converters then say
    what is wrong with it)."""
    return _BY_TYPE.get(model_type(hf_dir_or_config), GPT)
