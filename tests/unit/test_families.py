"""The text families' table (megappo.models.families) is what the config reader, the conversion's names and the
export read: each entry has its tiny model for the tests, names real transformers classes, and the architecture
read from a config follows it."""
from __future__ import annotations

import pytest

import torch

from megappo.convert.mapping import param_maps
from megappo.convert.mcore_to_hf import output_config
from megappo.models.families import FAMILIES
from megappo.models.hf_config import read_hf_architecture
from megappo.testing import FAMILIES as TINY, tiny_hf_config


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_has_a_tiny_model_and_real_classes(family):
    import transformers

    fam = FAMILIES[family]
    assert TINY[family][1] == fam.causal_lm
    assert getattr(transformers, fam.causal_lm) and getattr(transformers, fam.seq_cls)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_architecture_read_follows_the_table(family):
    fam, cfg = FAMILIES[family], tiny_hf_config(family).to_dict()
    arch = read_hf_architecture(cfg)
    assert (arch.qkv_bias, arch.qk_norm, bool(arch.num_experts)) == (fam.qkv_bias, fam.qk_norm, fam.moe is not None)
    assert bool(arch.shared_expert_size) == fam.shared_expert
    hf_names = {n for pm in param_maps(arch) for n in pm.hf}
    if fam.moe is not None:
        assert f"model.layers.0.{fam.moe.block}.gate.weight" in hf_names
        assert f"model.layers.0.{fam.moe.block}.experts.0.{fam.moe.down}.weight" in hf_names
    assert output_config(cfg, "critic", torch.float32)["architectures"] == [fam.seq_cls]

