"""How megappo's `SDPAttention` holds the sequences it attends over, chosen once per attention layer.

- `LocalSequences`: this rank holds whole sequences, as padded rows [s, b, ...] (megatron's mask as given, or
  causal), as a pack in megatron's THD format (`packing.attend_packed`: attention within each sequence) or as a
  shared-prefix pack (`prefix.attend_shared`: each response over its prompt and itself);
- `ContextParallelSequences`: this CP rank holds its two chunks of each row (`context_parallel`). K and V are
  all-gathered over the CP group (autograd-aware: their gradients are summed back) and each local query attends to
  the keys at or before its global position: megatron's "all_gather" CP scheme, the same result as CP=1; a
  micro-batch of tree rows (`prefix_cp`, prefix sharing) attends under its tree mask instead. Packed micro-batches
  do not run under CP (the plan runs them padded).
"""
from __future__ import annotations

from typing import Any, Optional, Union

from megatron.core.transformer.enums import AttnMaskType
from torch import Tensor

from megappo.models.layout.context_parallel import causal_attend, gather_sequence
from megappo.models.layout.packing import attend_packed
from megappo.models.layout.prefix import SharedPrefixParams, attend_shared
from megappo.models.layout.prefix_cp import TreeRowParams

__all__ = ["LocalSequences", "ContextParallelSequences", "sequence_layout"]


class LocalSequences:
    """Whole sequences on this rank: padded rows, or a pack."""

    def attend(self, attn: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
               attention_bias: Optional[Tensor], packed_seq_params: Any) -> Tensor:
        if isinstance(packed_seq_params, SharedPrefixParams):
            return attend_shared(attn, query, key, value, attention_mask, packed_seq_params)
        if packed_seq_params is not None:
            return attend_packed(attn, query, key, value, attention_mask, packed_seq_params)
        attn.check_dense(query, key, attention_bias)
        return attn.attend(query, key, value, *attn.local_mask(attention_mask, query.size(0), key.size(0)))


class ContextParallelSequences:
    """This CP rank's chunks r and 2cp-1-r of each row's 2cp (causal self attention, no mask passed, not packed)."""

    def __init__(self, size: int, group: Any):
        self.size, self.group = size, group

    def attend(self, attn: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
               attention_bias: Optional[Tensor], packed_seq_params: Any) -> Tensor:
        """key/value [s/cp, b, ng, hn] -> the whole sequence's [s, b, ng, hn] in global order, attended under the
        [s/cp, s] mask (True = attend) of the local queries' causal attention at their global positions, or the
        tree rows' [b, 1, s/cp, s] mask (`prefix_cp`: each branch over its prompt and itself)."""
        if packed_seq_params is not None and not isinstance(packed_seq_params, TreeRowParams):
            raise NotImplementedError("SDPAttention runs context parallelism on padded micro-batches only, not "
                                      "packed ones (megappo.models.compute does not pack under CP)")
        attn.check_dense(query, key, attention_bias)
        if attention_mask is not None or attn.attn_mask_type != AttnMaskType.causal:
            raise NotImplementedError("SDPAttention's context parallelism is for causal self attention without an "
                                      "explicit mask (rows left-aligned, as megappo.models.compute runs them)")
        s = key.size(0) * self.size
        key = gather_sequence(key, 0, self.group, s)
        value = gather_sequence(value, 0, self.group, s)
        mask = (causal_attend(s, self.size, self.group.rank(), str(key.device)) if packed_seq_params is None
                else packed_seq_params.attend_mask(key.device))
        return attn.attend(query, key, value, mask, False, None)


def sequence_layout(config: Any, pg_collection: Any) -> Union[LocalSequences, ContextParallelSequences]:
    """The layout of a layer built with megatron's `config` (context_parallel_size) and process groups."""
    size = int(getattr(config, "context_parallel_size", 1) or 1)
    if size == 1:
        return LocalSequences()
    group = getattr(pg_collection, "cp", None)
    if group is None:
        from megatron.core import parallel_state as mpu

        group = mpu.get_context_parallel_group()
    return ContextParallelSequences(size, group)


def check_context_parallel_attention(layout: Any, attention_does_cp: bool) -> None:
    """LayoutError when `layout` (a `ParallelLayout`) runs context parallelism with an attention that cannot
    (`attention_does_cp`: transformer-engine's, or megappo's SDPAttention for this model). megatron's local
    DotProductAttention asserts context_parallel_size == 1; SDPAttention does CP but not sliding windows or other
    softmax types."""
    from megappo.platform.layout import LayoutError

    if layout.cp > 1 and not attention_does_cp:
        raise LayoutError(
            f"context_parallel_size={layout.cp} without transformer-engine needs megappo's SDPAttention, which does "
            "not support this model's attention (sliding window or softmax_type); use a GPU with transformer-engine "
            "or set actor_rollout_ref.actor.megatron.context_parallel_size=1"
        )
