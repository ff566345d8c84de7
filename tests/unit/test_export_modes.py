"""Exported files follow the umask like every other file of the output directory (safetensors' own save_file
writes 0600, which would leave a shared model directory's adapter unreadable to the group)."""
from __future__ import annotations

import os
import stat

import pytest
import torch

from megappo.convert.peft_io import write_peft_dir


@pytest.mark.parametrize("mask", [0o022, 0o002])
def test_the_lora_adapter_follows_the_umask(tmp_path, mask):
    old = os.umask(mask)
    try:
        out = write_peft_dir({"base_model.model.layers.0.q_proj.lora_A.weight": torch.zeros(2, 4)},
                             {"peft_type": "LORA"}, str(tmp_path / "adapter"))
    finally:
        os.umask(old)
    modes = {name: stat.S_IMODE(os.stat(os.path.join(out, name)).st_mode) for name in os.listdir(out)}
    assert modes == {"adapter_model.safetensors": 0o666 & ~mask, "adapter_config.json": 0o666 & ~mask}
