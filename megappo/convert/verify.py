"""`megappo convert verify` (`megappo.kinds.commands.verify`, which asks the model's kind): run the same tokens
through the Hugging Face model (transformers) and the converted megatron checkpoint (any layout) and compare the
outputs. Here: the text families' comparison (`verify_gpt`) and the forwards every kind shares.

Causal LMs compare logits [B, T, vocab] (megatron's padded vocabulary columns dropped); critic / reward models
compare the value head on every token ([B, T]: HF `score(model(x).last_hidden_state)`). Both models run in
float32 by default so the comparison measures the conversion, not the storage precision.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from megappo.convert.collectives import last_stage_output

if TYPE_CHECKING:  # megappo modules load when a command runs
    from megappo.parallel import ParallelState

DEFAULT_ATOL = 1e-3  # float32 forward of the same weights: measured differences are ~1e-6


def verify_tokens(vocab_size: int, batch: int, seq_len: int, seed: int = 0, avoid: Optional[int] = None) -> torch.Tensor:
    """Deterministic token ids [batch, seq_len] in [0, vocab_size), never the pad id `avoid` (HF's seq-cls pooling
    would stop there)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq_len), generator=gen)
    if avoid is not None:
        ids[ids == avoid] = (avoid + 1) % vocab_size
    return ids


@torch.no_grad()
def mcore_forward(model_chunks: list[nn.Module], parallel_state: ParallelState, input_ids: torch.Tensor,
                  vocab_size: Optional[int] = None) -> Optional[torch.Tensor]:
    """Forward `input_ids` [B, T] through megatron chunks (any TP/PP/VPP/EP layout); collective over the world.

    Returns on every rank: logits [B, T, vocab_size] (TP shards all-gathered over `tp_group`, padding columns cut)
    for a causal LM, or values [B, T] for a value model. The last pipeline stage's result is broadcast over
    `pp_group`.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ps = parallel_state
    b, t = input_ids.shape
    device = next(model_chunks[0].parameters()).device
    # the interleaved (VPP) schedule needs at least pp micro-batches: split the rows, or repeat the batch
    m = ps.pp_size if len(model_chunks) > 1 else 1
    rows = [input_ids[i::m] for i in range(m)] if b % m == 0 else [input_ids] * m
    micro = [(r.to(device), torch.arange(t, device=device).unsqueeze(0).expand(r.shape[0], t)) for r in rows]
    for chunk in model_chunks:
        chunk.eval()

    def forward_step(data_iterator, model):
        ids, positions = next(data_iterator)
        out = model(ids, positions, None)  # attention_mask None: megatron's causal mask
        return out, lambda output, non_loss_data=True: output

    fb = get_forward_backward_func()
    outs = fb(forward_step_func=forward_step, data_iterator=[iter(micro) for _ in model_chunks],
              model=model_chunks if len(model_chunks) > 1 else model_chunks[0], num_microbatches=m, seq_length=t,
              micro_batch_size=micro[0][0].shape[0], forward_only=True, collect_non_loss_data=True)
    is_value = getattr(model_chunks[-1], "megappo_role", "actor") in ("critic", "reward")
    out: Optional[torch.Tensor] = None
    if ps.is_pipeline_last_stage:
        if b % m == 0:  # undo the strided split: micro-batch i holds rows i, i+m, ...
            out = torch.stack([o.float() for o in outs], dim=1).reshape(b, *outs[0].shape[1:])
        else:
            out = outs[0].float()
    return last_stage_output(out, ps, is_value, vocab_size, device)


def require_local_hf_dir(hf_dir: str, flag: str = "--hf") -> None:
    """ConversionError unless `hf_dir` is a local directory with a config.json: verify never downloads (a hub id
    would make transformers fetch and possibly run code from the network)."""
    from megappo.convert.mapping import ConversionError

    if not os.path.isdir(hf_dir):
        raise ConversionError(
            f"{flag} {hf_dir}: no such local directory; verify reads a local Hugging Face model directory and never "
            f"downloads. For a hub model, download it first (e.g. `huggingface-cli download {hf_dir} --local-dir "
            f"DIR`) and pass {flag} DIR"
        )
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise ConversionError(f"{flag} {hf_dir}: has no config.json; pass a Hugging Face model directory")


@torch.no_grad()
def hf_forward(hf_dir: str, input_ids: torch.Tensor, value: bool, dtype: torch.dtype = torch.float32, *,
               trust_remote_code: bool = False) -> torch.Tensor:
    """HF logits [B, T, V] (causal LM) or per-token values [B, T] (`score` over the last hidden states).

    Local files only; code shipped with the model (config `auto_map`) runs only with trust_remote_code=True."""
    import transformers

    from megappo.convert.mapping import ConversionError

    require_local_hf_dir(hf_dir)
    kw = dict(dtype=dtype, trust_remote_code=trust_remote_code, local_files_only=True)
    auto = transformers.AutoModelForSequenceClassification if value else transformers.AutoModelForCausalLM
    try:
        model = auto.from_pretrained(hf_dir, **kw)
    except ValueError as e:
        if trust_remote_code or "trust_remote_code" not in str(e):
            raise
        raise ConversionError(f"--hf {hf_dir}: its config.json asks to run Python shipped with the model (auto_map); "
                              f"pass --trust-remote-code if you trust that code") from e
    model.eval()
    if value:
        hidden = model.model(input_ids=input_ids).last_hidden_state
        return model.score(hidden).squeeze(-1).float()
    return model(input_ids=input_ids).logits.float()


def verify_gpt(hf_dir: str, chunks: list[nn.Module], ps: ParallelState, mcfg: dict, *, atol: float,
               dtype: torch.dtype, seed: int = 0, batch: int = 2, seq_len: int = 16,
               trust_remote_code: bool = False) -> dict[str, Any]:
    """`verify` of a text model: random tokens through loaded megatron `chunks` and `hf_dir`; collective."""
    role = getattr(chunks[0], "megappo_role", "actor")
    device = next(chunks[0].parameters()).device
    ids = verify_tokens(int(mcfg["vocab_size"]), batch, seq_len, seed, avoid=mcfg.get("pad_token_id"))
    is_value = role in ("critic", "reward")
    ours = mcore_forward(chunks, ps, ids, vocab_size=int(mcfg["vocab_size"]))
    result: dict[str, Any] = dict(atol=atol, shape=tuple(ours.shape), role=role)
    diff = torch.zeros(1, device=device)  # broadcast below: on the GPU for NCCL
    if ps.rank == 0:
        theirs = hf_forward(hf_dir, ids, is_value, dtype, trust_remote_code=trust_remote_code)
        if theirs.shape != ours.shape:
            raise RuntimeError(f"output shapes differ: HF {tuple(theirs.shape)} vs megatron {tuple(ours.shape)}")
        diff = (theirs - ours).abs().max().reshape(1).to(device)
    if dist.get_world_size() > 1:
        dist.broadcast(diff, src=0)
    result.update(max_abs_diff=float(diff.item()), ok=bool(diff.item() <= atol))
    return result
