"""Prefix sharing (`actor_rollout_ref.model.use_prefix_sharing`): a GRPO group's prompt runs once, not n times.

A micro-batch's rows whose real prompt tokens are equal (the `rollout.n` samples of one prompt) become one *tree*
in a pack [1, T] (megatron's THD format, as `packing`): the prompt once, then each row's response, one after the
other. Every other row is a tree of its own, its whole sequence as the "prompt" with no responses (what `packing`
does with it). So that each response sees what it saw in its own row, and nothing else:

- attention (`attend_shared`): the prompt attends causally to itself; response i's tokens attend to the whole
  prompt and causally to response i, never to another response (a [L_i, P + L_i] mask, bottom-right causal; a
  tree's responses padded to its longest and run as one SDPA call). No [T, T] mask: the work is P^2 / 2 +
  sum_i L_i (P + L_i) scores per tree instead of sum_i (P + L_i)^2 / 2;
- positions: response i's tokens have positions P .. P + L_i - 1, as if it followed the prompt alone. Megatron's
  GPTModel computes its rotary table from a sequence length, not from position ids; `install_prefix_positions`
  (once per chunk, at build) makes the table the pack's per-token positions when the pack carries them
  (`SharedPrefixParams.rotary_positions`), and megatron's THD rope reads a table of one row per packed token at
  each token's own row (`_apply_rotary_pos_emb_thd`'s exact-offset mapping). Learned absolute position embeddings
  read `position_ids`, which carry the same positions.

Every other layer is per token, so log-probs, entropy, values, losses and gradients equal the unshared paths up to
float summation order (tests/unit/test_prefix_sharing.py, tests/multirank/test_prefix_sharing_layouts.py).
Outputs are read back per row (`SharedPack.window`): a response's column reads its own token; the last prompt
column, which predicts every response's first token, is the tree's one prompt token, shared.

Under context parallelism the plan runs padded micro-batches; there a group is one tree row instead (`prefix_cp`),
with the same rules. Not with transformer-engine's attention or fused rope (their kernels take no tree mask):
`can_share` says where it runs. `sharing_pays` counts the same saving in both (a prompt's tokens per extra row).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from torch import Tensor, nn

from megappo.models.batch import ModelBatch
from megappo.models.layout import prefix_sharing_refusal

__all__ = ["SharedPack", "SharedPrefixParams", "Tree", "prompt_groups", "share_micro_batch",
           "attend_shared", "install_prefix_positions", "can_share", "sharing_on", "sharing_pays"]


class Tree(NamedTuple):
    """One tree of a shared pack: a prompt at `start` of `prompt_len` tokens, then its responses
    ((start, length) each, adjacent, in row order)."""

    start: int
    prompt_len: int
    responses: tuple  # ((start, length), ...)


@dataclass
class SharedPrefixParams(PackedSeqParams):
    """megatron's THD `PackedSeqParams` of a shared pack: `cu_seqlens` mark the trees (so that megatron's rope reads
    the per-token table at each token's own row), the trees' structure rides along for `attend_shared`, and the
    per-token rotary positions for `install_prefix_positions`."""

    trees: tuple = ()  # (Tree, ...)
    rotary_positions: Optional[Tensor] = None  # [T] long
    _plan: Any = field(default=None, repr=False)  # attend_shared's index tensors, built once per forward

    def rotary_table(self, rotary: nn.Module, output: Tensor) -> Tensor:
        """megatron's rotary table [s, 1, 1, d] -> its rows at the pack's positions [T, 1, 1, d]."""
        return output.index_select(0, self.rotary_positions.to(output.device))


def prompt_groups(mb: ModelBatch) -> list[list[int]]:
    """Rows of `mb` grouped by equal real prompt tokens, in order of first appearance (padding rows, those
    without a prompt token, alone)."""
    plen = mb.prompt_lengths().tolist()
    p = mb.prompt_len
    groups: dict[Any, list[int]] = {}
    for i, n in enumerate(plen):
        key = tuple(mb.input_ids[i, p - n: p].tolist()) if n > 0 else ("row", i)
        groups.setdefault(key, []).append(i)
    return list(groups.values())


@dataclass
class SharedPack:
    """One shared micro-batch: the model's inputs and where each row's tokens sit (the interface of
    `packing.Pack`, so the `Packed` layout runs it unchanged)."""

    input_ids: Tensor  # [1, T] long
    position_ids: Tensor  # [1, T] long: each token's position in its own row
    cu_seqlens: Tensor  # [n_trees + 1] int32 (the tail padding, if any, a tree of its own)
    max_seqlen: int  # the longest row (1 + the largest position)
    trees: tuple  # (Tree, ...)
    prompt_starts: Tensor  # [b] long: row i's prompt in the pack
    prompt_lens: Tensor  # [b] long: its tree's prompt length (a row alone: its whole length)
    response_starts: Tensor  # [b] long: row i's response in the pack (a row alone: unused)
    lengths: Tensor  # [b] long: row i's real tokens (0: a padding row)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def packed_seq_params(self) -> SharedPrefixParams:
        return SharedPrefixParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                                  max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen, trees=self.trees,
                                  rotary_positions=self.position_ids[0])

    def window(self, output: Tensor, window: Tensor) -> Tensor:
        """output [1, T, ...], window [b, R] (columns of the left-aligned rows) -> [b, R, ...]; columns past a row's
        last token read that token (padding, masked out downstream)."""
        col = torch.minimum(window, (self.lengths - 1).clamp(min=0).unsqueeze(1))  # [b, R]
        p = self.prompt_lens.unsqueeze(1)
        idx = torch.where(col < p, self.prompt_starts.unsqueeze(1) + col, self.response_starts.unsqueeze(1) + col - p)
        idx = idx.clamp_(0, self.num_tokens - 1)
        flat = output[0]
        return flat.index_select(0, idx.reshape(-1)).view(*idx.shape, *flat.shape[1:])


def share_micro_batch(mb: ModelBatch, pack_len: Optional[int] = None, multiple: int = 1,
                      pad_token_id: int = 0) -> SharedPack:
    """Lay `mb`'s rows out as trees (module doc). `pack_len` / `multiple`: pad the tail as `pack_micro_batch`."""
    ids, pos = mb.left_aligned()  # row i's real tokens at columns 0..L_i-1, positions 0..L_i-1
    s, b = mb.seq_len, mb.batch_size
    plen = mb.prompt_lengths().to(torch.long).tolist()
    lengths = (mb.prompt_lengths().to(torch.long) + mb.response_lengths().to(torch.long)).tolist()
    p_start, p_len, r_start = [0] * b, [0] * b, [0] * b
    pieces: list[Tensor] = []  # flat indices into ids [b * s], in pack order
    trees, bounds, at = [], [0], 0
    for group in prompt_groups(mb):
        group = [i for i in group if lengths[i] > 0]
        if not group:
            continue
        shared = len(group) > 1
        p = plen[group[0]] if shared else lengths[group[0]]
        pieces.append(group[0] * s + torch.arange(p))
        start, at, responses = at, at + p, []
        for i in group:
            p_start[i], p_len[i] = start, p
            if shared:
                r = lengths[i] - p
                r_start[i] = at
                pieces.append(i * s + p + torch.arange(r))
                if r > 0:
                    responses.append((at, r))
                at += r
        trees.append(Tree(start, p, tuple(responses)))
        bounds.append(at)
    index = torch.cat(pieces).to(ids.device) if pieces else torch.zeros(0, dtype=torch.long, device=ids.device)
    flat_ids, flat_pos = ids.reshape(-1)[index], pos.reshape(-1)[index]
    target = -(-max(at, pack_len or 0, 1) // multiple) * multiple
    if target > at:  # the tail padding: a tree of pad tokens alone
        tail = target - at
        flat_ids = torch.cat([flat_ids, flat_ids.new_full((tail,), pad_token_id)])
        flat_pos = torch.cat([flat_pos, torch.arange(tail, device=flat_pos.device)])
        trees.append(Tree(at, tail, ()))
        bounds.append(target)
    long = dict(dtype=torch.long, device=ids.device)
    return SharedPack(flat_ids.unsqueeze(0), flat_pos.unsqueeze(0),
                      torch.tensor(bounds, dtype=torch.int32, device=ids.device), int(flat_pos.max()) + 1,
                      tuple(trees), torch.tensor(p_start, **long), torch.tensor(p_len, **long),
                      torch.tensor(r_start, **long), torch.tensor(lengths, **long))


class _TreePlan(NamedTuple):
    """A tree's responses as one padded SDPA call: n responses padded to `width` tokens."""

    prompt: slice
    n: int
    width: int
    q_index: Optional[Tensor]  # [n * width] pack rows of the queries (padding: the response's first token)
    kv_index: Optional[Tensor]  # [n * (P + width)] pack rows of the keys (the prompt's, then the response's)
    mask: Optional[Tensor]  # [n, 1, width, P + width] bool, True = attend
    keep: Optional[Tensor]  # [sum L_i] rows of the [n * width] outputs that are real, in pack order


def _tree_plan(tree: Tree, device: torch.device) -> _TreePlan:
    prompt = slice(tree.start, tree.start + tree.prompt_len)
    if not tree.responses:
        return _TreePlan(prompt, 0, 0, None, None, None, None)
    p, n = tree.prompt_len, len(tree.responses)
    width = max(r for _, r in tree.responses)
    cols = torch.arange(width)
    lens = torch.tensor([r for _, r in tree.responses])
    starts = torch.tensor([a for a, _ in tree.responses])
    real = cols.unsqueeze(0) < lens.unsqueeze(1)  # [n, width]
    q_index = torch.where(real, starts.unsqueeze(1) + cols, starts.unsqueeze(1))
    kv_index = torch.cat([torch.arange(tree.start, tree.start + p).expand(n, p), q_index], 1)
    causal = (cols.unsqueeze(1) >= cols.unsqueeze(0)) & real.unsqueeze(1)  # [n, width (q), width (k)]
    mask = torch.cat([torch.ones(n, width, p, dtype=torch.bool), causal], 2).unsqueeze(1)
    keep = real.reshape(-1).nonzero().squeeze(1)
    return _TreePlan(prompt, n, width, q_index.reshape(-1).to(device), kv_index.reshape(-1).to(device),
                     mask.to(device), keep.to(device))


def attend_shared(attn: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                  params: SharedPrefixParams) -> Tensor:
    """`SDPAttention` (`attn`) over a shared pack: query [t, np, hn], key/value [t, ng, hn] -> [t, np * hn]; each
    prompt causal over itself, each response over its prompt and causally over itself (module doc)."""
    if attention_mask is not None or attn.attn_mask_type != AttnMaskType.causal:
        raise NotImplementedError("a shared-prefix pack is causal self attention without an attention_mask")
    t, nq, hn = query.shape
    attn.check_heads(nq, key.size(1))
    if params._plan is None or params._plan[0] != (t, str(query.device)):
        params._plan = ((t, str(query.device)), [_tree_plan(tree, query.device) for tree in params.trees])
    plans = params._plan[1]
    # CPU flash attention reads grouped heads under a mask; CUDA's memory-efficient kernel (masks) refuses them
    key, value, gqa = attn.grouped_heads(key, value, nq, query.device.type == "cpu")

    def heads_first(x: Tensor, rows: int) -> Tensor:  # [rows * L, h, d] -> [rows, h, L, d]
        return x.unflatten(0, (rows, -1)).transpose(1, 2)

    def attend(dropout_p: float) -> list[Tensor]:
        outs = []
        for tp in plans:
            pq, pk, pv = (heads_first(x[tp.prompt], 1) for x in (query, key, value))
            out = F.scaled_dot_product_attention(pq, pk, pv, dropout_p=dropout_p, is_causal=pq.size(2) > 1,
                                                 scale=attn.softmax_scale, **gqa)  # [1, np, P, hn]
            outs.append(out.transpose(1, 2).reshape(-1, nq * hn))
            if tp.n:
                rq = heads_first(query.index_select(0, tp.q_index), tp.n)
                rk, rv = (heads_first(x.index_select(0, tp.kv_index), tp.n) for x in (key, value))
                out = F.scaled_dot_product_attention(rq, rk, rv, attn_mask=tp.mask, dropout_p=dropout_p,
                                                     scale=attn.softmax_scale, **gqa)  # [n, np, width, hn]
                outs.append(out.transpose(1, 2).reshape(-1, nq * hn).index_select(0, tp.keep))
        return outs

    outs = attn.run_attention(attend)
    return torch.cat(outs) if len(outs) > 1 else outs[0]  # trees in pack order, each prompt then responses


def _rotary_positions_pre_hook(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Before a GPTModel forward: hand its rotary module the params that place each token (None: megatron's own
    table): a shared pack's or a CP micro-batch's tree rows (`prefix_cp`), both with a `rotary_table`."""
    params = kwargs.get("packed_seq_params")
    model.rotary_pos_emb.megappo_positions = params if hasattr(params, "rotary_table") else None


def _rotary_positions_hook(rotary: nn.Module, args: tuple, output: Tensor) -> Tensor:
    """megatron's rotary table -> the rows of each token's own position, where the params give them."""
    params = getattr(rotary, "megappo_positions", None)
    return output if params is None else params.rotary_table(rotary, output)


def install_prefix_positions(model: nn.Module) -> None:
    """Let a GPTModel chunk with plain rotary embeddings run shared packs (module doc): called once at build.
    Marks the chunk `megappo_prefix_positions` (True where installed or where position ids suffice)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    kind = getattr(model, "position_embedding_type", None)
    rotary = getattr(model, "rotary_pos_emb", None)
    if kind == "rope" and type(rotary) is RotaryEmbedding and not getattr(model.config, "apply_rope_fusion", False) \
            and not getattr(model.config, "multi_latent_attention", False):
        model.register_forward_pre_hook(_rotary_positions_pre_hook, with_kwargs=True)
        rotary.register_forward_hook(_rotary_positions_hook)
        model.megappo_prefix_positions = True
    else:
        model.megappo_prefix_positions = kind in ("learned_absolute", "none")


def can_share(inner: nn.Module, replaying: bool = False) -> Optional[str]:
    """Why an (unwrapped) chunk cannot run shared micro-batches (packs, or tree rows under context parallelism),
    or None: it needs megappo's SDPAttention, its positions installed, and no router replay (`replaying`: its MoE
    routers replay or record routes, `megappo.models.router_replay`)."""
    if replaying:
        return prefix_sharing_refusal(packed=True, cp_size=1, replaying=True)
    if not getattr(inner, "megappo_sdpa_attention", False):
        return ("prefix sharing needs megappo's SDPAttention (the local spec; transformer-engine's attention takes "
                "no tree mask): set actor_rollout_ref.model.use_prefix_sharing=false")
    if not getattr(inner, "megappo_prefix_positions", False):
        return ("prefix sharing needs plain rotary or learned position embeddings (not mrope, yarn, MLA or fused "
                "rope): set actor_rollout_ref.model.use_prefix_sharing=false")
    return None


# Auto (`share_prefix=None`) shares a batch where prompts of at least MIN_PROMPT tokens, shared, drop at least
# MIN_SAVED_FRACTION of its packed tokens. Measured (tools/bench/bench_prefix_sharing.py, hidden 256, 4 layers, 8
# responses a prompt, CPU): 6% saved (prompt 64, responses 512-1024) is 0.83x, slower: a tree's responses run
# padded to its longest under an explicit mask; 23% saved (128, 256-512) 1.12-1.19x; 33% (256, 256-512) 1.4x;
# 75% (1024, 64-256) 3.3x. Under context parallelism a group's tree row attends densely (`sharing_pays`'s
# `tree_rows`): (256, 256-512), whose row has 3x the attention scores of its rows alone, stays unshared there
# (measured shared at CP2: 0.47x log-prob pass, 0.94x step), and (1024, 64-256), half of them, shares (2.4x, 3.7x;
# `--cp 2`, one group, a loaded 2-core machine: +-30%). Shorter prompts also gain
# (32, 8-32: 1.6x) but little time in all; sharing them would move the tiny recipes' golden numbers in their last
# bits, so it takes use_prefix_sharing=true.
MIN_SAVED_FRACTION = 0.25
MIN_PROMPT = 64


def sharing_pays(batch: ModelBatch, tree_rows: bool = False, groups: Optional[list[list[int]]] = None) -> bool:
    """Whether sharing `batch`'s repeated prompts of >= MIN_PROMPT tokens saves >= MIN_SAVED_FRACTION of its tokens.
    `tree_rows`: the micro-batches run as context-parallel tree rows (`prefix_cp`), whose attention is one dense
    masked call over a group's whole row: then also only where that is no more attention scores than the rows
    alone (sum of squared lengths; long prompts with short responses, not long responses). `groups`: the batch's
    `prompt_groups`, when the caller has them."""
    plen = batch.prompt_lengths().to(torch.long)
    lengths = plen + batch.response_lengths().to(torch.long)
    total = int(lengths.sum())
    groups = prompt_groups(batch) if groups is None else groups
    saved = sum(int(plen[g[0]]) * (len(g) - 1) for g in groups if int(plen[g[0]]) >= MIN_PROMPT)
    if total == 0 or saved < MIN_SAVED_FRACTION * total:
        return False
    if not tree_rows:
        return True
    shared = sum(int(lengths[g].sum() - (plen[g[0]] - 1) * (len(g) - 1)) ** 2 if len(g) > 1
                 else int(lengths[g[0]]) ** 2 for g in groups)
    return shared <= int((lengths ** 2).sum())


def sharing_on(share_prefix: Optional[bool], inner: nn.Module, cp_size: int, packed: bool,
               batch: ModelBatch, replaying: bool = False) -> bool:
    """Whether a step's micro-batches run shared (`MicroBatching.share_prefix`: None where it pays and the model
    can, True wherever a prompt repeats (an error where the model cannot), False never). `packed`: whether the step
    runs packs at all (under context parallelism it runs tree rows, `prefix_cp`, instead); `inner`: the unwrapped
    first chunk; `replaying`: as `can_share`."""
    if share_prefix is False:
        return False
    refusal = can_share(inner, replaying) or prefix_sharing_refusal(packed, cp_size, replaying)
    if refusal is not None:
        if share_prefix:
            raise ValueError(refusal)
        return False
    groups = prompt_groups(batch)
    if not any(len(g) > 1 for g in groups):
        return False
    return bool(share_prefix) or sharing_pays(batch, tree_rows=cp_size > 1, groups=groups)
