"""Paged attention in plain torch.

Each layer owns a K and a V cache of shape [num_blocks, block_size,
num_kv_heads, head_dim]; a request's tokens live in the blocks its block table
lists (block 0 is the null block and is never written). A step first writes
the new K/V of *every* token of the batch, and only then lets any sequence
read: two requests in one step may share a block that one of them fills in
that very step (DESIGN invariant 8).

Reads gather the context through flat slot indices built once per step and
shared by the layers of one KV cache group (one metadata per group). A
sliding-window group's metadata reads only each query's window (keys
p-W+1..p): the table entries before it may be the null block. A fresh
prefill attends to its own new k/v directly; decodes whose block tables
begin with the same blocks (a shared prompt prefix) read that prefix once
for the whole group, not once per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class SeqSpan:
    """One multi-token sequence of the batch (a prefill chunk), for the attention read."""

    query_start: int
    """Index of its first token in the flattened batch."""
    query_len: int
    context_len: int
    """Keys it reads: positions [end - context_len, end) (all of [0, end) unless windowed)."""
    slots: torch.Tensor | None
    """[context_len] flat cache slots of the context (long); None when the context is
    exactly this step's new tokens, all written (a fresh prefill): they are read from
    the batch's k/v directly, which hold the same values."""
    mask: torch.Tensor
    """[query_len, context_len] bool, True = may attend."""


@dataclass(slots=True)
class DecodeGroup:
    """Single-token sequences attended in one padded call.

    Either sequences of similar context length, or sequences whose block tables
    begin with the same blocks (a shared prompt prefix): then that prefix is
    read once for the whole group instead of once per sequence.
    """

    index: torch.Tensor
    """[B] their positions in the flattened batch."""
    slots: torch.Tensor
    """[B, S] flat cache slots of each context after the shared prefix, padded with
    slot 0 (the null block, zeros) up to the group's longest S."""
    mask: torch.Tensor
    """[B, 1, 1, S] bool, True for real context, False for padding."""
    prefix_slots: torch.Tensor | None = None
    """[P] flat cache slots of the prefix all sequences of the group share (positions
    [0, P) of each); None when they share none."""


DECODE_GROUP = 16
"""Decodes sorted by context length are attended in groups of this many, each padded
only to its own longest context (one padded call over a whole batch of mixed lengths
gathers mostly padding)."""


@dataclass(slots=True)
class AttentionMetadata:
    """Where each new token's K/V goes and what each sequence reads; shared by all layers."""

    write_slots: torch.Tensor
    """Flat cache slots (block_id * block_size + offset) of the tokens that are written."""
    write_index: torch.Tensor | None
    """Which batch tokens are written; None when all of them are (the common case)."""
    prefills: list[SeqSpan]
    """Sequences with several query tokens, attended one by one."""
    decodes: list[DecodeGroup]
    """The single-token sequences: groups sharing a prompt prefix, the others in groups
    of similar context length."""
    window: int | None = None
    """Sliding window of the group's layers (None: full attention)."""

    @classmethod
    def build(
        cls,
        spans: list[tuple[int, int, list[int], int]],
        block_size: int,
        device: torch.device,
        window: int | None = None,
    ) -> AttentionMetadata:
        """From (start_pos, num_tokens, block_table, skip_write_until) per sequence.

        A position p lives in slot block_table[p // block_size] * block_size +
        p % block_size; positions below skip_write_until already hold their K/V
        (a fully cached prompt) and are attended to but not written. With a
        `window`, a query at position p reads only keys p-W+1..p.
        """
        slot_parts: list[torch.Tensor] = []  # written slots, in batch order
        index_parts: list[torch.Tensor] = []  # batch positions of the written tokens
        decode_slots: list[int] = []  # runs of decodes, joined into one tensor
        decode_rows: list[int] = []
        skipped = False
        prefills: list[SeqSpan] = []
        decodes: list[tuple[int, int, list[int]]] = []
        query_start = 0
        for start, num, table, skip in spans:
            end = start + num
            needed = -(-end // block_size)
            if len(table) < needed:
                raise ValueError(
                    f"block table of {len(table)} blocks cannot hold {end} tokens "
                    f"(block size {block_size})"
                )
            first = max(start, skip)  # positions [first, end) are written
            if first < end and 0 in table[first // block_size : needed]:
                p = next(p for p in range(first, end) if table[p // block_size] == 0)
                raise ValueError(f"position {p} would be written into the null block 0")
            skipped |= first > start
            if num == 1:
                decodes.append((query_start, end, table[:needed]))
                if first < end:
                    decode_slots.append(
                        table[start // block_size] * block_size + start % block_size
                    )
                    decode_rows.append(query_start)
            else:
                slots = _slots(table[:needed], end, block_size, device)
                fresh = start == 0 and skip == 0
                mask = _causal_mask(start, num, device, window)
                lo = 0 if fresh or window is None else max(0, start - window + 1)
                read = None if fresh else slots[lo:]
                prefills.append(SeqSpan(query_start, num, end - lo, read, mask[:, lo:]))
                if first < end:
                    _flush(decode_slots, decode_rows, slot_parts, index_parts, device)
                    slot_parts.append(slots[first:])
                    index_parts.append(
                        torch.arange(query_start + first - start, query_start + num, device=device)
                    )
            query_start += num
        _flush(decode_slots, decode_rows, slot_parts, index_parts, device)
        empty = torch.empty(0, dtype=torch.long, device=device)
        slot_tensor = torch.cat(slot_parts) if slot_parts else empty
        index = None
        if skipped:
            index = torch.cat(index_parts) if index_parts else empty
        groups = _decode_groups(decodes, block_size, device, window)
        return cls(slot_tensor, index, prefills, groups, window)


def _slots(table: list[int], end: int, block_size: int, device: torch.device) -> torch.Tensor:
    """Flat cache slots of positions [0, end) through a block table."""
    blocks = torch.tensor(table, dtype=torch.long, device=device)
    pos = torch.arange(end, device=device)
    return blocks[pos // block_size] * block_size + pos % block_size


def _flush(
    slots: list[int],
    rows: list[int],
    slot_parts: list[torch.Tensor],
    index_parts: list[torch.Tensor],
    device: torch.device,
) -> None:
    """Move a run of decode writes (python ints) into the tensor parts, keeping batch order."""
    if slots:
        slot_parts.append(torch.tensor(slots, dtype=torch.long, device=device))
        index_parts.append(torch.tensor(rows, dtype=torch.long, device=device))
        slots.clear()
        rows.clear()


SHARED_PREFIX_MIN_BLOCKS = 4
"""Decodes whose tables share at least this many leading blocks read them once, together."""


def _decode_groups(
    decodes: list[tuple[int, int, list[int]]],
    block_size: int,
    device: torch.device,
    window: int | None = None,
) -> list[DecodeGroup]:
    """(batch position, context length, block table) per decode -> padded groups."""
    if window is not None:
        # No shared prefix: the head of a windowed table is the null block.
        ordered = sorted(decodes, key=lambda d: d[1])
        return [
            _window_decode_group(ordered[i : i + DECODE_GROUP], window, block_size, device)
            for i in range(0, len(ordered), DECODE_GROUP)
        ]
    by_first: dict[int, list[tuple[int, int, list[int]]]] = {}
    for d in decodes:
        by_first.setdefault(d[2][0], []).append(d)
    groups = []
    rest = []
    for part in by_first.values():
        shared = _common_blocks([t for _, _, t in part]) if len(part) > 1 else 0
        prefix = min(shared * block_size, min(n for _, n, _ in part))
        if shared < SHARED_PREFIX_MIN_BLOCKS or prefix < block_size:
            rest.extend(part)
            continue
        groups.append(_decode_group(part, prefix, block_size, device))
    rest.sort(key=lambda d: d[1])
    for i in range(0, len(rest), DECODE_GROUP):
        groups.append(_decode_group(rest[i : i + DECODE_GROUP], 0, block_size, device))
    return groups


def _common_blocks(tables: list[list[int]]) -> int:
    """How many leading block ids all tables have in common."""
    first = tables[0]
    n = min(len(t) for t in tables)
    for t in tables[1:]:
        i = 0
        while i < n and t[i] == first[i]:
            i += 1
        n = i
    return n


def _decode_group(
    part: list[tuple[int, int, list[int]]], prefix: int, block_size: int, device: torch.device
) -> DecodeGroup:
    """One group; positions below `prefix` are read through the shared prefix slots."""
    width = max(len(t) for _, _, t in part)
    tables = torch.tensor(
        [t + [0] * (width - len(t)) for _, _, t in part], dtype=torch.long, device=device
    )
    lens = torch.tensor([n for _, n, _ in part], dtype=torch.long, device=device)
    pos = torch.arange(prefix, max(int(lens.max()), prefix + 1), device=device)
    valid = pos[None, :] < lens[:, None]
    slots = tables[:, pos // block_size] * block_size + pos % block_size
    prefix_slots = None
    if prefix:
        head = torch.arange(prefix, device=device)
        prefix_slots = tables[0, head // block_size] * block_size + head % block_size
    return DecodeGroup(
        torch.tensor([q for q, _, _ in part], dtype=torch.long, device=device),
        slots.masked_fill_(~valid, 0),
        valid[:, None, None, :],
        prefix_slots,
    )


def _window_decode_group(
    part: list[tuple[int, int, list[int]]], window: int, block_size: int, device: torch.device
) -> DecodeGroup:
    """Each decode at position n - 1 reads only keys n - W .. n - 1 (padding: null slot 0)."""
    width = max(len(t) for _, _, t in part)
    tables = torch.tensor(
        [t + [0] * (width - len(t)) for _, _, t in part], dtype=torch.long, device=device
    )
    lens = torch.tensor([n for _, n, _ in part], dtype=torch.long, device=device)
    span = min(window, int(lens.max()))
    pos = lens[:, None] - span + torch.arange(span, device=device)[None, :]
    valid = pos >= 0
    pos = pos.clamp_(min=0)
    slots = tables.gather(1, pos // block_size) * block_size + pos % block_size
    return DecodeGroup(
        torch.tensor([q for q, _, _ in part], dtype=torch.long, device=device),
        slots.masked_fill_(~valid, 0),
        valid[:, None, None, :],
    )


def _causal_mask(
    start: int, num: int, device: torch.device, window: int | None = None
) -> torch.Tensor:
    """Query i (at position start + i) sees keys 0 .. start + i (the last `window` of them)."""
    keys = torch.arange(start + num, device=device)
    queries = torch.arange(start, start + num, device=device)
    mask = keys[None, :] <= queries[:, None]
    if window is not None:
        mask &= keys[None, :] > queries[:, None] - window
    return mask


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
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of the batch's queries [T, heads, head_dim] over their paged context.

    Writes all of k/v first, then reads; returns [T, heads * head_dim]. With
    `softcap` the scores are soft-capped (softcap * tanh(score / softcap))
    before the mask and the softmax, as Gemma does.
    """
    write_kv(k, v, k_cache, v_cache, meta)
    k_flat = k_cache.flatten(0, 1)
    v_flat = v_cache.flatten(0, 1)
    out = torch.empty_like(q)
    for span in meta.prefills:
        rows = slice(span.query_start, span.query_start + span.query_len)
        if span.slots is None:
            keys, values = k[rows], v[rows]
        else:
            keys, values = k_flat[span.slots], v_flat[span.slots]
        # 4-D with enable_gqa: the kv heads are not copied per query head, and torch's
        # CPU flash kernel takes this path (twice as fast as 3-D with repeated heads).
        query = q[rows].transpose(0, 1)[None]
        keys = keys.transpose(0, 1)[None]
        values = values.transpose(0, 1)[None]
        if softcap is None:
            attn = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=span.mask, scale=scale, enable_gqa=True
            )
        else:
            groups = query.shape[1] // keys.shape[1]
            keys = keys.repeat_interleave(groups, dim=1)
            values = values.repeat_interleave(groups, dim=1)
            attn = _capped_attention(query, keys, values, span.mask, scale, softcap)
        out[rows] = attn[0].transpose(0, 1)
    for group in meta.decodes:
        out[group.index] = _decode_attention(
            q[group.index], k_cache, v_cache, group, scale, softcap
        )
    return out.flatten(1)


def _capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    if softcap is None:
        return scores
    return torch.tanh(scores / softcap) * softcap


def _capped_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """softmax(cap(q k^T * scale) masked) v, the softmax in float32 (transformers' eager path)."""
    scores = _capped(torch.matmul(query, keys.transpose(-1, -2)) * scale, softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, values)


def _decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
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
    batch, num_heads, dim = query.shape
    kv_heads = k_cache.shape[2]
    k_flat = k_cache.flatten(0, 1)
    v_flat = v_cache.flatten(0, 1)
    query = query.view(batch, kv_heads, num_heads // kv_heads, dim)
    keys = k_flat[group.slots].transpose(1, 2)  # [B, kv_heads, S, dim]
    values = v_flat[group.slots].transpose(1, 2)
    if group.prefix_slots is None:
        if softcap is None:
            attn = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=group.mask, scale=scale
            )
        else:
            attn = _capped_attention(query, keys, values, group.mask, scale, softcap)
        return attn.reshape(batch, num_heads, dim)
    # Shared prefix: its keys and values are gathered once, and every query of the
    # group ([kv_heads, B * groups] rows) meets them in one matrix product; the
    # softmax runs over the prefix and each sequence's own tail together.
    prefix_keys = k_flat[group.prefix_slots].transpose(0, 1)  # [kv_heads, P, dim]
    prefix_values = v_flat[group.prefix_slots].transpose(0, 1)
    rows = query.transpose(0, 1).reshape(kv_heads, -1, dim)  # [kv_heads, B * groups, dim]
    prefix_scores = _capped(torch.matmul(rows, prefix_keys.transpose(1, 2)).mul_(scale), softcap)
    prefix_len = prefix_scores.shape[-1]
    own_scores = _capped(torch.matmul(query, keys.transpose(2, 3)).mul_(scale), softcap)
    own_scores.masked_fill_(~group.mask, float("-inf"))
    scores = torch.cat(
        (prefix_scores.view(kv_heads, batch, -1, prefix_len).transpose(0, 1), own_scores),
        dim=-1,
    ).softmax(dim=-1)
    prefix_probs = scores[..., :prefix_len].transpose(0, 1).reshape(kv_heads, -1, prefix_len)
    out = torch.matmul(prefix_probs, prefix_values)  # [kv_heads, B * groups, dim]
    out = out.view(kv_heads, batch, -1, dim).transpose(0, 1)
    out = out + torch.matmul(scores[..., prefix_len:], values)
    return out.reshape(batch, num_heads, dim)
