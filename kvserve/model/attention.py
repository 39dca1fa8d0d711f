"""Paged attention in plain torch.

Each layer owns a K and a V cache of shape [num_blocks, block_size,
num_kv_heads, head_dim]; a request's tokens live in the blocks its block table
lists (block 0 is the null block and is never written). A step first writes
the new K/V of *every* token of the batch, and only then lets any sequence
read: two requests in one step may share a block that one of them fills in
that very step (DESIGN invariant 8).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class SeqSpan:
    """One sequence of the batch, for the attention read."""

    query_start: int
    """Index of its first token in the flattened batch."""
    query_len: int
    context_len: int
    """Keys it attends to: positions [0, context_len)."""
    block_table: torch.Tensor
    """Physical block ids covering the context (long, on the cache's device)."""
    mask: torch.Tensor | None
    """[query_len, context_len] bool, True = may attend; None when no mask is needed."""


@dataclass(slots=True)
class AttentionMetadata:
    """Where each new token's K/V goes and what each sequence reads; shared by all layers."""

    write_slots: torch.Tensor
    """Flat cache slots (block_id * block_size + offset) of the tokens that are written."""
    write_index: torch.Tensor | None
    """Which batch tokens are written; None when all of them are (the common case)."""
    prefills: list[SeqSpan]
    """Sequences with several query tokens, attended one by one."""
    decode_index: torch.Tensor | None
    """Batch positions of the single-token sequences, attended in one padded call."""
    decode_block_tables: torch.Tensor | None
    """[num_decodes, max_blocks] block ids, padded with the null block."""
    decode_valid: torch.Tensor | None
    """[num_decodes, max_blocks * block_size] bool, True for real context, False for padding."""

    @classmethod
    def build(
        cls,
        spans: list[tuple[int, int, list[int], int]],
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        """From (start_pos, num_tokens, block_table, skip_write_until) per sequence.

        A position p lives in slot block_table[p // block_size] * block_size +
        p % block_size; positions below skip_write_until already hold their K/V
        (a fully cached prompt) and are attended to but not written.
        """
        slots: list[int] = []
        skipped = False
        prefills: list[SeqSpan] = []
        decode_at: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        query_start = 0
        for start, num, table, skip in spans:
            end = start + num
            needed = -(-end // block_size)
            if len(table) < needed:
                raise ValueError(
                    f"block table of {len(table)} blocks cannot hold {end} tokens "
                    f"(block size {block_size})"
                )
            for p in range(start, end):
                if p < skip:
                    slots.append(-1)
                    skipped = True
                    continue
                block = table[p // block_size]
                if block == 0:
                    raise ValueError(f"position {p} would be written into the null block 0")
                slots.append(block * block_size + p % block_size)
            if num == 1:
                decode_at.append(query_start)
                decode_tables.append(table[:needed])
                decode_lens.append(end)
            else:
                prefills.append(
                    SeqSpan(
                        query_start,
                        num,
                        end,
                        torch.tensor(table[:needed], dtype=torch.long, device=device),
                        _causal_mask(start, num, device),
                    )
                )
            query_start += num
        slot_tensor = torch.tensor(slots, dtype=torch.long, device=device)
        write_index = None
        if skipped:
            write_index = torch.nonzero(slot_tensor >= 0).flatten()
            slot_tensor = slot_tensor[write_index]
        meta = cls(slot_tensor, write_index, prefills, None, None, None)
        if decode_at:
            width = max(len(t) for t in decode_tables)
            padded = [t + [0] * (width - len(t)) for t in decode_tables]
            meta.decode_index = torch.tensor(decode_at, dtype=torch.long, device=device)
            meta.decode_block_tables = torch.tensor(padded, dtype=torch.long, device=device)
            lens = torch.tensor(decode_lens, dtype=torch.long, device=device)
            keys = torch.arange(width * block_size, device=device)
            meta.decode_valid = keys[None, :] < lens[:, None]
        return meta


def _causal_mask(start: int, num: int, device: torch.device) -> torch.Tensor:
    """Query i (at position start + i) sees keys 0 .. start + i."""
    keys = torch.arange(start + num, device=device)
    queries = torch.arange(start, start + num, device=device)
    return keys[None, :] <= queries[:, None]


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    """Store the new [T, kv_heads, head_dim] keys and values at their slots."""
    if meta.write_index is not None:
        k = k[meta.write_index]
        v = v[meta.write_index]
    if k.shape[0] == 0:
        return
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, meta.write_slots, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, meta.write_slots, v)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of the batch's queries [T, heads, head_dim] over their paged context.

    Writes all of k/v first, then reads; returns [T, heads * head_dim].
    """
    write_kv(k, v, k_cache, v_cache, meta)
    num_heads = q.shape[1]
    groups = num_heads // k_cache.shape[2]
    out = torch.empty_like(q)
    for span in meta.prefills:
        keys = _gather(k_cache, span.block_table, span.context_len)
        values = _gather(v_cache, span.block_table, span.context_len)
        query = q[span.query_start : span.query_start + span.query_len].transpose(0, 1)
        attn = F.scaled_dot_product_attention(
            query,
            _expand_heads(keys.transpose(0, 1), groups, dim=0),
            _expand_heads(values.transpose(0, 1), groups, dim=0),
            attn_mask=span.mask,
            scale=scale,
        )
        out[span.query_start : span.query_start + span.query_len] = attn.transpose(0, 1)
    if meta.decode_index is not None:
        out[meta.decode_index] = _decode_attention(q, k_cache, v_cache, meta, groups, scale)
    return out.flatten(1)


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    groups: int,
    scale: float,
) -> torch.Tensor:
    """All single-token queries at once, over block tables padded with the null block."""
    tables = meta.decode_block_tables
    valid = meta.decode_valid
    padding = ~valid[:, :, None, None]
    query = q[meta.decode_index][:, :, None, :]  # [B, heads, 1, head_dim]
    # The tail of a last block may be uninitialised memory (even NaN): zero it,
    # because a masked score still multiplies its value (0 * NaN = NaN).
    keys = k_cache[tables].flatten(1, 2).masked_fill_(padding, 0).transpose(1, 2)
    values = v_cache[tables].flatten(1, 2).masked_fill_(padding, 0).transpose(1, 2)
    attn = F.scaled_dot_product_attention(
        query,  # keys, values: [B, kv_heads, S, head_dim] before the GQA expansion
        _expand_heads(keys, groups, dim=1),
        _expand_heads(values, groups, dim=1),
        attn_mask=valid[:, None, None, :],
        scale=scale,
    )
    return attn[:, :, 0, :]


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[length, kv_heads, head_dim]: one sequence's context, read through its block table."""
    return cache[block_table].flatten(0, 1)[:length]


def _expand_heads(x: torch.Tensor, groups: int, dim: int) -> torch.Tensor:
    """Grouped-query attention: query head h reads kv head h // groups."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=dim)
