"""Qwen2.5-VL / Qwen2-VL on megatron-core: the vision tower (first pipeline stage) feeding a `GPTModel` with
multimodal rotary positions (`position_embedding_type="mrope"`).

`build_vlm_model(hf_dir_or_config, role, parallel_state, platform)` is this kind's `build` (`megappo.kinds`); it
returns one `VLMModel` per pipeline chunk. The language model is a text model's chunk (`megappo.models.chunk`: same
layer spec, SDPA attention, value head for critic/reward), so everything megappo does to a GPTModel holds for
`chunk.language_model`.

Parameter names: `language_model.<GPTModel names>` and, on the first stage, `vision_model.<VisionModel names>`
(see megappo.kinds.qwen2_vl.vision).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import torch
from torch import nn

from megatron.core.transformer.module import MegatronModule

from megappo.kinds.qwen2_vl.config import VLMArgs, read_vlm_config
from megappo.kinds.qwen2_vl.rope_index import mrope_position_ids
from megappo.kinds.qwen2_vl.vision import VisionModel
from megappo.models.chunk import build_chunk
from megappo.models.hf_config import UnsupportedModelError, transformer_config_from_hf

class VLMModel(MegatronModule):
    """One pipeline chunk: `vision_model` (first stage only) + `language_model` (a GPTModel with mrope).

    forward(input_ids [B, T], position_ids=None, attention_mask=None, pixel_values=None [N, C*tp*p*p],
    image_grid_thw=None [I, 3], token_mask=None [B, T]) -> what the GPTModel returns: vocab-parallel logits [B, T, V/tp] (actor), values
    [B, T] (critic) on the last stage, hidden states [T, B, H] elsewhere. position_ids: None or [B, T] computes
    the mrope positions from input_ids and image_grid_thw (every stage needs them for its rotary embedding);
    [3, B, T] is taken as given.
    """

    def __init__(self, language_model: nn.Module, vision_model: Optional[VisionModel], args: VLMArgs):
        super().__init__(config=language_model.config)  # the pipeline schedules read model.config
        self.language_model = language_model
        self.vision_model = vision_model
        self.vlm_args = args
        self.model_type = language_model.model_type  # read by the pipeline schedules (encoder_or_decoder)
        self.pre_process = language_model.pre_process
        self.post_process = language_model.post_process

    def set_input_tensor(self, input_tensor) -> None:
        self.language_model.set_input_tensor(input_tensor)

    # megatron's finalize_model_grads all-reduces tied embeddings over the first and last stages through these
    @property
    def share_embeddings_and_output_weights(self) -> bool:
        return self.language_model.share_embeddings_and_output_weights

    def shared_embedding_or_output_weight(self):
        return self.language_model.shared_embedding_or_output_weight()

    def micro_batch_inputs(self, mb: Any, layout: Any) -> dict[str, Any]:
        """What this model takes beyond its layout's inputs for a micro-batch (`megappo.models.compute` asks):
        its images and mrope positions (`megappo.kinds.qwen2_vl.inputs.micro_batch_inputs`)."""
        from megappo.kinds.qwen2_vl.inputs import micro_batch_inputs

        return micro_batch_inputs(self, mb, layout)

    def mrope_positions(self, input_ids, image_grid_thw=None, attention_mask=None, image_mask=None) -> torch.Tensor:
        return mrope_position_ids(input_ids, image_grid_thw, self.vlm_args.image_token_id,
                                  self.vlm_args.vision.spatial_merge_size, attention_mask, image_mask)

    def embed(self, input_ids: torch.Tensor, pixel_values=None, image_grid_thw=None, image_mask=None) -> torch.Tensor:
        """Token embeddings with the image placeholders (`image_mask` [B, T], default: every image token) replaced
        by the vision tower's output: [T, B, H]."""
        emb = self.language_model.embedding(input_ids=input_ids, position_ids=None)  # [T, B, H]
        if pixel_values is None:
            return emb
        image = self.vision_model(pixel_values, image_grid_thw).to(emb.dtype)
        mask = image_mask.bool() if image_mask is not None else (input_ids == self.vlm_args.image_token_id)
        if int(mask.sum()) != image.shape[0]:
            raise ValueError(f"{int(mask.sum())} image tokens in input_ids but the images give {image.shape[0]} "
                             "embeddings; the prompt's placeholders must match image_grid_thw")
        # scatter in [B, T] order: the images are numbered row by row over the batch, as the HF processor writes
        return emb.transpose(0, 1).masked_scatter(mask[..., None], image).transpose(0, 1).contiguous()

    def forward(self, input_ids, position_ids=None, attention_mask=None, pixel_values=None, image_grid_thw=None,
                token_mask=None, image_mask=None, **kwargs):
        if position_ids is None or position_ids.dim() == 2:
            # token_mask [B, T] (1 real, 0 padding): the mrope count follows the real tokens only, as HF's
            # get_rope_index with its attention mask
            position_ids = self.mrope_positions(input_ids, image_grid_thw, token_mask, image_mask)
        decoder_input = self.embed(input_ids, pixel_values, image_grid_thw, image_mask) if self.pre_process else None
        return self.language_model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                                   decoder_input=decoder_input, **kwargs)


def vlm_transformer_config(hf_dir_or_config, layout, platform, **overrides):
    """(TransformerConfig, ModelSpecArgs, VLMArgs) of the language model."""
    args = read_vlm_config(hf_dir_or_config)
    if layout.sequence_parallel or layout.cp > 1:
        raise UnsupportedModelError(f"{args.family}: sequence and context parallelism are not supported yet")
    config, spec = transformer_config_from_hf(args.text_config, layout, platform,
                                              mrope_section=args.text_config["mrope_section"], **overrides)
    spec = dataclasses.replace(spec, family=args.family, position_embedding_type="mrope",
                               hf_architecture=f"{args.family}")
    return config, spec, args


def build_vlm_model(hf_dir_or_config, role: str, parallel_state, platform, *, seed: int = 0,
                    config_overrides: Optional[Mapping[str, Any]] = None, freeze_vision_tower: bool = True,
                    make_vocab_size_divisible_by: int = 128) -> list[nn.Module]:
    """This rank's `VLMModel` chunks for `role`; the vision tower (and merger) frozen when `freeze_vision_tower`."""
    from megatron.core import tensor_parallel

    from megappo.platform.layout import check_layout

    layout = parallel_state.layout
    config, spec, args = vlm_transformer_config(hf_dir_or_config, layout, platform,
                                                make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                                                **dict(config_overrides or {}))
    check_layout(layout, parallel_state.world_size, num_attention_heads=config.num_attention_heads,
                 num_key_value_heads=config.num_query_groups, num_layers=config.num_layers, num_experts=None)
    if args.vision.num_heads % layout.tp:
        raise UnsupportedModelError(f"vision num_heads {args.vision.num_heads} not divisible by TP {layout.tp}")
    if parallel_state.vpp_size is not None:
        raise UnsupportedModelError(f"{args.family}: virtual pipeline stages are not supported yet")
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    lm = build_chunk(config, spec, role, parallel_state, platform, None, seed)
    vision = None
    if lm.pre_process:
        vision = VisionModel(args.vision, layout.tp, config.params_dtype, use_cpu_init=not platform.is_cuda)
    model = VLMModel(lm, vision, args)
    if platform.is_cuda:
        model = model.to(platform.device)
    if vision is not None and (freeze_vision_tower or role == "ref"):
        vision.requires_grad_(False)
    model.megappo_config, model.megappo_spec, model.megappo_role = config, spec, role
    lm.megappo_config, lm.megappo_spec, lm.megappo_role = config, spec, role
    model.megappo_sdpa_attention = lm.megappo_sdpa_attention
    if role == "ref":
        model.eval()
        model.requires_grad_(False)
    return [model]
