"""Copy checkpoint-named tensors into a live `transformers` model: the in-process engine's weight sync.

The trainer exports Hugging Face *checkpoint* names (`megappo.kinds.weights.iter_hf_weights`, the same tensors
`mcore-to-hf` writes). transformers 5 builds MoE models with fused expert parameters and renames some modules when
it loads a checkpoint, so a checkpoint name is not always a parameter name:
- `...experts.{e}.gate_proj|w1` and `up_proj|w3` are rows [0:F] and [F:2F] of `...experts.gate_up_proj[e]`
  ([E, 2F, H]); `down_proj|w2` is `...experts.down_proj[e]` ([E, H, F]);
- Mixtral's `block_sparse_moe.` is `mlp.`;
- a Qwen2(.5)-VL checkpoint's `model.*` (the language model) is `model.language_model.*` and its `visual.*` is
  `model.visual.*` (transformers 5's module tree; `megappo.kinds.qwen2_vl.convert` exports the checkpoint names).
Every target is shape-checked, and tests compare against `from_pretrained` on the same files, which applies
transformers' own conversion.
"""
from __future__ import annotations

import re
import torch
from torch import nn

_RENAMES = ((".block_sparse_moe.", ".mlp."),)
# checkpoint prefix -> module prefix, tried when the name itself is not a parameter (VLMs under transformers 5)
_PREFIXES = (("model.", "model.language_model."), ("visual.", "model.visual."))
_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<w>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
# checkpoint projection -> (fused parameter, half of gate_up_proj or None)
_FUSED = {"gate_proj": ("gate_up_proj", 0), "w1": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
          "w3": ("gate_up_proj", 1), "down_proj": ("down_proj", None), "w2": ("down_proj", None)}


class HFWeightLoader:
    """`load(name, tensor)` copies one checkpoint-named tensor into `model` in place."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.params = dict(model.named_parameters(remove_duplicate=False))
        # A parameter's first name: tied weights (lm_head = embed_tokens) are one parameter.
        self._canonical = {id(p): n for n, p in model.named_parameters()}

    def target(self, name: str) -> tuple[str, torch.Tensor]:
        """(canonical parameter name, the view of it that the checkpoint tensor `name` fills)."""
        n = name
        for old, new in _RENAMES:
            n = n.replace(old, new)
        p = self.params.get(n)
        if p is None:
            for old, new in _PREFIXES:
                if n.startswith(old) and new + n[len(old):] in self.params:
                    n = new + n[len(old):]
                    p = self.params[n]
                    break
        if p is not None:
            return self._canonical[id(p)], p.data
        m = _EXPERT.match(n)
        if m is not None:
            fused, half = _FUSED[m["w"]]
            p = self.params.get(f"{m['prefix']}.{fused}")
            if p is not None and p.dim() == 3:
                view = p.data[int(m["e"])]
                if half is not None:
                    f = view.shape[0] // 2
                    view = view[half * f:(half + 1) * f]
                return self._canonical[id(p)], view
        raise KeyError(f"{name}: no parameter of this {type(self.model).__name__} takes it (is the engine's model "
                       f"the architecture the trainer exports?)")

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor) -> str:
        """Copy `tensor` into its place; return the canonical parameter name it went to."""
        canonical, view = self.target(name)
        if tuple(view.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: tensor of shape {tuple(tensor.shape)} does not fit {canonical} "
                             f"(slot of shape {tuple(view.shape)})")
        view.copy_(tensor)
        return canonical

    def incomplete(self, filled: dict[str, int]) -> list[str]:
        """Parameters that `filled` ({canonical name: elements copied}, summed over `load` calls) does not cover."""
        sizes = {n: p.numel() for n, p in self.model.named_parameters()}
        return sorted(n for n, size in sizes.items() if filled.get(n, 0) < size)
