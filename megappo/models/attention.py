"""`SDPAttention`: megatron's core attention on `torch.nn.functional.scaled_dot_product_attention`.

Why it exists. Without transformer-engine (CPU, and GPUs without TE) megatron's local layer spec runs
`megatron.core.transformer.dot_product_attention.DotProductAttention`: it repeats the KV heads for GQA, materialises
the [b, np, sq, sk] scores with `baddbmm`, applies an explicit [b, 1, s, s] boolean mask with `masked_fill` and a
separate softmax, then a `bmm` with V. torch's SDPA runs the same maths in one fused kernel (flash attention on CPU,
flash / memory-efficient / cuDNN on CUDA) that never stores the scores, skips the masked half of a causal
product, and reads grouped KV heads in place (`enable_gqa`). megappo's builder swaps this class in for
`DotProductAttention` whenever it builds the local spec (see `megappo.models.chunk.build_chunk`).

Interface. It implements megatron-core 0.16.1's `CoreAttention` / `CoreAttentionBuilder` protocols
(`megatron/core/transformer/attention.py`) exactly as `DotProductAttention` does, so `SelfAttention` builds and
calls it unchanged (also under selective recompute of "core_attn"):

- `__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=None, softmax_scale=None,
  cp_comm_type=None, pg_collection=None)`;
- `forward(query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None)`
  with query [sq, b, np, hn], key/value [sk, b, ng, hn] (this tensor-parallel rank's heads: np query heads and ng
  query groups per partition) -> context [sq, b, np * hn].

Semantics, matched to `DotProductAttention`:

- Mask. A given `attention_mask` is boolean, True where attention is blocked, broadcastable to [b, np, sq, sk]. If
  it is exactly the causal mask (checked once per mask tensor, then cached), SDPA runs with `is_causal=True`;
  otherwise SDPA gets `attn_mask=~mask`. A query row whose keys are all blocked gets, as in megatron (which fills
  blocked scores with -10000, so such a row's softmax is uniform), the mean of the values (not dropped out).
  Blocked positions get exactly zero weight here; in megatron exp(-10000 - max) underflows to zero unless a real
  score is below ~-9900.
  With no mask, `attn_mask_type=causal` (the GPT spec's) gives causal attention for sq > 1 (sq must equal sk) and
  no mask for sq == 1 (a decode step), any other type no mask. As in megatron, the `attn_mask_type` forward
  argument is not used; the one given at construction is.
- Scale: `softmax_scale` (megatron passes `config.softmax_scale`), else 1 / sqrt(kv_channels).
  `apply_query_key_layer_scaling` divides the scores by the layer number and multiplies them back in an fp32 softmax
  in megatron, a guard against fp16 overflow of the scores with the same result; SDPA's fused kernels accumulate the
  scores in fp32, so it is the plain scale here.
- Precision (`attention_softmax_in_fp32`): for fp16/bf16 inputs torch's fused kernels (CPU flash attention, CUDA
  flash, memory-efficient and cuDNN attention) keep the scores and the softmax in fp32 and round only the output,
  which is what the flag asks for; megatron rounds the scores to half before its fp32 softmax and the
  probabilities after it, so this is at least as precise. Inputs are not upcast (that would rule out the fused
  kernels on GPU).
- Dropout: `attention_dropout` (else `config.attention_dropout`) becomes SDPA's `dropout_p` in training mode only,
  drawn inside megatron's model-parallel RNG tracker (as megatron does) unless sequence parallelism is on.
- GQA: `enable_gqa=True` where torch supports it (torch >= 2.5) and a fused kernel reads grouped heads in place
  (CPU flash attention; on CUDA flash attention, i.e. fp16/bf16 without an explicit mask: memory-efficient
  attention refuses GQA); otherwise the KV heads are repeated first, as megatron does, so that the memory-efficient
  kernel (fp32, explicit masks) still applies.

Packed sequences (megatron's THD format, `qkv_format == "thd"`, `megappo.models.layout.packing`):
query/key/value arrive as [t, heads, hn], the sequences concatenated at `cu_seqlens`; each sequence attends to
itself only (block-diagonal attention without a [t, t] mask), causally for `attn_mask_type=causal` (the language
model's packs) or bidirectionally for `no_mask` (the vision tower's windows and images), and the context is
[t, np * hn]. Sequences of equal length run as one batched SDPA call ([k, np, L, hn]: a view when they are adjacent,
else gathered): a ViT's windows are mostly of one size, and one call per window would cost more in Python than in
attention. `SDPAttention.group_equal_lengths = False` runs one call per sequence (for benchmarks).
`DotProductAttention` refuses packed sequences. A shared-prefix pack (`megappo.models.layout.prefix`: a prompt once,
then its responses) attends each response to its prompt and causally to itself.

Context parallelism (megatron's layout, `megappo.models.layout.attention`): with context_parallel_size > 1 a
rank's query/key/value are its 2 sequence chunks (r and 2cp-1-r of 2cp) of causal self attention (no mask passed,
not packed). K and V are all-gathered over the CP group (autograd-aware: their gradients are summed back) and
each local query attends to the keys at or before its global position: megatron's "all_gather" CP scheme, the
same result as CP=1. `DotProductAttention` refuses CP.

Not supported (the builder keeps megatron's class then, see `SDPAttention.supports`): sliding-window attention,
`softmax_type` other than "vanilla"; packed sequences under context parallelism. `attention_bias` is refused as in
`DotProductAttention`.
"""
from __future__ import annotations

import math
import weakref
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide

from megappo.models.layout.attention import sequence_layout

__all__ = ["SDPAttention"]

T = TypeVar("T")


def _torch_has_enable_gqa() -> bool:
    try:
        major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (2, 5)


_HAS_ENABLE_GQA = _torch_has_enable_gqa()

# The last mask checked for being the causal mask: (weak reference, its version counter, result). Every layer of a
# model gets the same mask tensor in a forward, so the check (one device-to-host sync) runs once per forward.
_LAST_MASK_CHECK: Optional[tuple[Any, int, bool]] = None


def _is_causal_mask(mask: Tensor, sq: int, sk: int) -> bool:
    """True when `mask` (True = blocked) is exactly the causal mask of [sq, sk], broadcast over batch and heads."""
    global _LAST_MASK_CHECK
    if sq != sk or mask.dim() < 2 or tuple(mask.shape[-2:]) != (sq, sk):
        return False
    cached = _LAST_MASK_CHECK
    if cached is not None and cached[0]() is mask and cached[1] == mask._version:
        return cached[2]
    causal = torch.ones(sq, sk, dtype=torch.bool, device=mask.device).triu_(1)
    result = bool(torch.equal(mask, causal.expand(mask.shape)))
    try:
        _LAST_MASK_CHECK = (weakref.ref(mask), mask._version, result)
    except TypeError:  # a tensor subclass without weak references: no cache
        _LAST_MASK_CHECK = None
    return result


class SDPAttention(MegatronModule):
    """Drop-in for megatron-core's `DotProductAttention` on torch's `scaled_dot_product_attention` (module doc)."""

    # packed sequences of equal length run as one batched SDPA call (False: one call per sequence, for benchmarks)
    group_equal_lengths = True

    @staticmethod
    def supports(config: Any) -> bool:
        """Whether this class reproduces `DotProductAttention` for `config` (else keep megatron's)."""
        return (
            getattr(config, "softmax_type", "vanilla") == "vanilla"
            and not getattr(config, "window_size", None)
        )

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        self.config = config
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise NotImplementedError(f"SDPAttention supports softmax_type='vanilla' only, not "
                                      f"{config.softmax_type!r}")
        self.layer_number = max(1, layer_number)
        if is_layer_window_attention(getattr(config, "window_size", None),
                                     getattr(config, "window_attn_skip_freq", None), self.layer_number):
            raise NotImplementedError("SDPAttention does not support sliding-window attention")
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type  # unused, as in DotProductAttention

        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        elif not hasattr(pg_collection, "tp"):
            raise ValueError("SDPAttention pg_collection must have a tp process group")
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        self.sequence = sequence_layout(config, pg_collection)  # how this rank holds the sequences it attends over
        world_size = pg_collection.tp.size()
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, world_size)
        self.hidden_size_per_attention_head = divide(projection_size, config.num_attention_heads)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, world_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, world_size)

        self.softmax_scale = (1.0 / math.sqrt(self.hidden_size_per_attention_head) if softmax_scale is None
                              else softmax_scale)
        self.dropout_p = float(config.attention_dropout if attention_dropout is None else attention_dropout)
        self.softmax_offset = None  # DotProductAttention's attribute for softmax_type "vanilla"

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[Any] = None,
    ) -> Tensor:
        """query [sq, b, np, hn], key/value [sk, b, ng, hn], attention_mask bool (True = blocked) or None
        -> context [sq, b, np * hn] (THD: [t, np, hn], [t, ng, hn] -> [t, np * hn])."""
        return self.sequence.attend(self, query, key, value, attention_mask, attention_bias, packed_seq_params)

    def check_dense(self, query: Tensor, key: Tensor, attention_bias: Optional[Tensor]) -> None:
        """Refuse what `attend` does not run: an attention bias, query heads not a multiple of the KV heads."""
        if attention_bias is not None:
            raise NotImplementedError("attention bias is not supported by SDPAttention (nor by DotProductAttention)")
        self.check_heads(query.size(2), key.size(2))

    @staticmethod
    def check_heads(nq: int, nkv: int) -> None:
        """Refuse query heads that are not a multiple of the key/value heads (every layout asks)."""
        if nq % nkv:
            raise ValueError(f"{nq} query heads are not a multiple of {nkv} key/value heads")

    def local_mask(self, attention_mask: Optional[Tensor], sq: int,
                   sk: int) -> tuple[Optional[Tensor], bool, Optional[Tensor]]:
        """(SDPA's mask, True = attend, or None; is_causal; the query rows whose keys are all blocked, or None) of
        megatron's `attention_mask` (True = blocked) over keys this rank holds whole."""
        if attention_mask is None:
            if self.attn_mask_type == AttnMaskType.causal and sq > 1:
                if sq != sk:
                    raise ValueError(f"the causal mask is only for self attention (sq {sq} != sk {sk})")
                return None, True, None
            return None, False, None
        if attention_mask.dtype != torch.bool:
            raise TypeError(f"attention_mask must be boolean (True = blocked), got {attention_mask.dtype}")
        if _is_causal_mask(attention_mask, sq, sk):
            return None, True, None
        # rows with every key blocked: unblock them for SDPA, and give them the mean of V afterwards
        fully_blocked = attention_mask.all(dim=-1, keepdim=True)  # [..., sq, 1]
        return ~attention_mask | fully_blocked, False, fully_blocked

    def attend(self, query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
               fully_blocked: Optional[Tensor]) -> Tensor:
        """SDPA of query [sq, b, np, hn] over key/value [sk, b, ng, hn] -> [sq, b, np * hn]; attn_mask True = attend;
        rows in `fully_blocked` get the mean of V, as in megatron."""
        sq, b, nq, hn = query.shape
        # [s, b, h, d] -> [b, h, s, d] (views; SDPA takes strided inputs)
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        # CPU flash attention reads grouped heads; on CUDA only flash attention (half inputs, no mask) does:
        # memory-efficient attention refuses GQA, and SDPA would fall back to its unfused math path
        flash_gqa = attn_mask is None and q.dtype in (torch.float16, torch.bfloat16)
        k, v, gqa = self.grouped_heads(k, v, nq, q.device.type == "cpu" or flash_gqa)
        out = self.run_attention(lambda dropout_p: F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=self.softmax_scale,
            **gqa))  # [b, np, sq, hn]

        if fully_blocked is not None:
            v_mean = v.mean(dim=2, keepdim=True)  # [b, ng or np, 1, hn]
            if v_mean.size(1) != nq:
                v_mean = v_mean.repeat_interleave(nq // v_mean.size(1), dim=1)
            out = torch.where(fully_blocked, v_mean, out)

        # [b, np, sq, hn] -> [sq, b, np * hn]
        return out.permute(2, 0, 1, 3).reshape(sq, b, nq * hn)

    @staticmethod
    def grouped_heads(key: Tensor, value: Tensor, nq: int, fused: bool) -> tuple[Tensor, Tensor, dict]:
        """GQA: key/value with their heads at dim 1 -> (key, value, SDPA's extra arguments). The fused kernel reads
        grouped heads in place (`enable_gqa`) where torch has it and `fused` says the kernel SDPA picks does;
        otherwise the KV heads are repeated first, as megatron does."""
        nkv = key.size(1)
        if nq == nkv:
            return key, value, {}
        if _HAS_ENABLE_GQA and fused:
            return key, value, {"enable_gqa": True}
        return key.repeat_interleave(nq // nkv, dim=1), value.repeat_interleave(nq // nkv, dim=1), {}

    def run_attention(self, attend: Callable[[float], T]) -> T:
        """attend(dropout_p): dropout in training mode only, drawn inside megatron's model-parallel RNG tracker (as
        megatron does) unless sequence parallelism is on."""
        dropout_p = self.dropout_p if self.training else 0.0
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return attend(dropout_p)
        return attend(dropout_p)
