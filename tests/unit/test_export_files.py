"""What an export writes beside the weights: every file needed to load the model as its base was loaded (tokenizer,
chat templates, a vision-language model's processor, remote code), each following the umask like every other file
of the output directory (safetensors' own save_file writes 0600)."""
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


def test_the_side_files_are_every_file_the_base_is_loaded_with(tmp_path):
    import json

    from megappo.convert.hf_io import copy_side_files

    base, out = tmp_path / "base", tmp_path / "out"
    (base / "additional_chat_templates").mkdir(parents=True)
    out.mkdir()
    wanted = ["preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
              "chat_template.jinja", "chat_template.json", "tokenizer.json", "tokenizer_config.json",
              "qwen.tiktoken", "modeling_custom.py", "additional_chat_templates/tool_use.jinja"]
    for name in wanted + ["model.safetensors", "notes.txt"]:
        (base / name).write_text("x")
    (base / "config.json").write_text(json.dumps({"auto_map": {"AutoModel": "modeling_custom.Custom"}}))
    copy_side_files(str(base), str(out))
    got = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert got == sorted(wanted + ["config.json"])

    (base / "config.json").write_text("{}")  # no remote code: the .py files are not the model's
    plain = tmp_path / "plain"
    plain.mkdir()
    copy_side_files(str(base), str(plain))
    assert not (plain / "modeling_custom.py").exists() and (plain / "preprocessor_config.json").exists()
