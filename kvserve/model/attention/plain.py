"""Paged attention in plain torch.

Each layer owns a K and a V cache of shape [num_blocks, block_size,
num_kv_heads, head_dim]; a request's tokens live in the blocks its block table
lists (block 0 is the null block and is never written). A step first writes
the new K/V of *every* token of the batch, and only then lets any sequence
read: two requests in one step may share a block that one of them fills in
that very step (design.md invariant 8).

Reads gather the context through the flat slot indices of the step's
AttentionMetadata (kvserve.model.attention.attention_metadata). A fresh prefill
attends to its own new k/v directly; decodes are attended in padded groups of
similar context length, each row over its own slots (bfloat16 on the CPU: by the
paged C kernel of kvserve.model.cpu_kernels.attention, which reads the slots
in place instead of gathering them; a causal prefill there, fresh or after a cached
prefix, by its C kernel too).
Grouped-query attention never repeats the kv heads, except on the soft-capped
prefill path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvserve.model.attention.attention_metadata import AttentionMetadata, DecodeGroup
from kvserve.model.attention.paged_metadata import PagedMetadata
from kvserve.model.cpu_kernels.attention import kernel as attention_kernel

if TYPE_CHECKING:
    from kvserve.model.attention.flex_metadata import FlexMetadata


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    meta: AttentionMetadata | FlexMetadata,
) -> None:
    """Store the new [T, kv_heads, head_dim] keys and values at their slots of the flat
    caches ([num_blocks * block_size, kv_heads, head_dim])."""
    if meta.write_index is not None:
        k = k[meta.write_index]
        v = v[meta.write_index]
    if k.shape[0] == 0:
        return
    k_flat.index_copy_(0, meta.write_slots, k)
    v_flat.index_copy_(0, meta.write_slots, v)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata | FlexMetadata | PagedMetadata,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of the batch's queries [T, heads, head_dim] over their paged context.

    Writes all of k/v first, then reads; returns [T, heads * head_dim]. With
    `softcap` the scores are soft-capped (softcap * tanh(score / softcap))
    before the mask and the softmax, as Gemma does. FlexMetadata (the "flex"
    attention backend) sends the step to kvserve.model.attention.flex_attention instead, and
    PagedMetadata (the "triton" backend) to kvserve.model.attention.triton_attention.
    """
    if isinstance(meta, PagedMetadata):  # triton is imported for this backend only
        from kvserve.model.attention.triton_attention import triton_paged_attention

        return triton_paged_attention(q, k, v, k_cache, v_cache, meta, scale, softcap)
    k_flat = k_cache.flatten(0, 1)
    v_flat = v_cache.flatten(0, 1)
    write_kv(k, v, k_flat, v_flat, meta)
    if not isinstance(meta, AttentionMetadata):
        from kvserve.model.attention.flex_attention import flex_attention_read

        return flex_attention_read(q, k_flat, v_flat, meta, scale, softcap)
    if meta.whole_batch is not None:  # a lone decoding request, or decodes in batch order
        return _decode_attention(q, k_flat, v_flat, meta.whole_batch, scale, softcap).flatten(1)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    paged = attention_kernel()
    for span in meta.prefills:
        rows = slice(span.query_start, span.query_start + span.query_len)
        fresh = span.slots is None
        # the C kernel: a fresh causal prefill over its own rows, or one after a cached
        # prefix (no window: its context is all of [0, end)) read in place from the cache
        if paged and softcap is None and (span.causal if fresh else meta.window is None):
            kernel_k, kernel_v = (k[rows], v[rows]) if fresh else (k_flat, v_flat)
            if paged.prefills(q[rows], kernel_k, kernel_v):
                paged.prefill(q[rows], kernel_k, kernel_v, out[rows], scale, span.slots)
                continue
        if fresh:
            keys, values = k[rows], v[rows]
        else:
            keys, values = k_flat[span.slots], v_flat[span.slots]
        # 4-D with enable_gqa: the kv heads are not copied per query head, and torch's
        # CPU flash kernel takes this path (twice as fast as 3-D with repeated heads).
        query = q[rows].transpose(0, 1)[None]
        keys = keys.transpose(0, 1)[None]
        values = values.transpose(0, 1)[None]
        if softcap is None:
            mask = None if span.causal else span.mask
            attn = F.scaled_dot_product_attention(
                query,
                keys,
                values,
                attn_mask=mask,
                scale=scale,
                is_causal=span.causal,
                enable_gqa=True,
            )
        else:
            groups = query.shape[1] // keys.shape[1]
            keys = keys.repeat_interleave(groups, dim=1)
            values = values.repeat_interleave(groups, dim=1)
            attn = _capped_attention(query, keys, values, span.mask, scale, softcap)
        out[rows] = attn[0].transpose(0, 1)
    for group in meta.decodes:
        out[group.index] = _decode_attention(q[group.index], k_flat, v_flat, group, scale, softcap)
    return out.flatten(1)


def _capped_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """softmax(cap(q k^T * scale) masked) v, the softmax in float32 (transformers' eager path)."""
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, values)


def _decode_attention(
    query: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    group: DecodeGroup,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Single-token queries [B, heads, head_dim] over their padded contexts.

    Padding reads slot 0 of the null block, which holds zeros: never the
    uninitialised tail of a last block (a masked score still multiplies its
    value, and 0 * NaN = NaN). Grouped-query attention folds the query heads of
    one kv head into the query length: [B, kv_heads, groups, head_dim], so the
    kv heads are never repeated.
    """
    paged = attention_kernel()
    if paged is not None and group.bounds is not None and paged.handles(query, k_flat):
        return paged.decode(query, k_flat, v_flat, group.slots, group.bounds, scale, softcap)
    batch, num_heads, dim = query.shape
    kv_heads = k_flat.shape[1]
    query = query.reshape(batch, kv_heads, num_heads // kv_heads, dim)
    keys = _gather(k_flat, group.slots)  # [B, kv_heads, S, dim]
    values = _gather(v_flat, group.slots)
    if softcap is None:
        attn = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=group.mask, scale=scale
        )
    else:
        attn = _capped_attention(query, keys, values, group.mask, scale, softcap)
    return attn.reshape(batch, num_heads, dim)


def _gather(flat: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[B, kv_heads, S, dim] of the flat cache at [B, S] slots (index_select: a third of
    the cost of advanced indexing on the CPU)."""
    rows = flat.index_select(0, slots.view(-1))
    return rows.view(*slots.shape, *flat.shape[1:]).transpose(1, 2)
