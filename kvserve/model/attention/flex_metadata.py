"""The FlexAttention backend's metadata of one step, built once per KV cache group as
tensors (no per-sequence work per layer).

The whole step is one attention call. Queries are the batch's tokens, packed in batch
order; keys are every sequence's context gathered from the paged cache through its
block-table row, packed in the same order (a sliding-window group gathers only what
its queries' windows reach). Per query token: its sequence id and position; per key:
its sequence id, position and flat cache slot. A query attends to a key of its own
sequence at a position p with q - W < p <= q (W: the window, or unbounded).

Both sides are padded to bucketed sizes (powers of two from 128) so a compiled kernel
meets few shapes; padding keys read slot 0 of the null block (zeros) and belong to no
sequence. The BlockMask comes straight from these tensors: the packing keeps each
query tile's keys in one contiguous range (its first sequence's first key to its last
sequence's last key), so no dense mask is ever evaluated; `mask_mod` decides inside
the visited blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask

from kvserve.model.attention.paged_metadata import block_tables

BLOCK = 128
"""Key tile of the BlockMask (FlexAttention's default), and the smallest bucket."""
Q_TILE = 128
"""Query tile of the BlockMask: a tile visits the keys of every sequence it holds, so a
tile of 128 decodes (from 128 sequences) computes 128 scores per useful one. It must
divide BLOCK; a smaller one on a GPU is still to be measured."""
NO_WINDOW = 1 << 30
"""The window of a full-attention group: larger than any context."""


def bucket(n: int) -> int:
    """The padded size of n tokens: the next power of two, at least BLOCK."""
    return max(BLOCK, 1 << max(n - 1, 0).bit_length())


@dataclass(slots=True)
class FlexMetadata:
    """Where each new token's K/V goes and what the step's one attention call reads."""

    write_slots: torch.Tensor
    """Flat cache slots of the tokens that are written."""
    write_index: torch.Tensor | None
    """Which batch tokens are written; None when all of them are."""
    kv_slots: torch.Tensor
    """[bucketed keys] flat cache slots of the packed contexts (padding: slot 0)."""
    block_mask: BlockMask
    """Over the bucketed queries x keys; its seq_lengths give both padded sizes."""
    window: int | None = None
    """Sliding window of the group's layers (None: full attention)."""

    @classmethod
    def build(
        cls,
        spans: Sequence[tuple[int, int, Sequence[int], int]],
        block_size: int,
        device: torch.device,
        window: int | None = None,
    ) -> FlexMetadata:
        """From (start_pos, num_tokens, block_table, skip_write_until) per sequence, as
        AttentionMetadata.build: positions below skip_write_until hold their K/V already
        and are read, not written. Built on the CPU, then moved to `device` at once."""
        starts = torch.tensor([s for s, _, _, _ in spans], dtype=torch.long)
        nums = torch.tensor([n for _, n, _, _ in spans], dtype=torch.long)
        skips = torch.tensor([k for _, _, _, k in spans], dtype=torch.long)
        ends = starts + nums
        tables = block_tables(spans, block_size)
        seqs = torch.arange(len(spans))
        # Queries: sequence id and position of every token of the batch.
        q_seq = seqs.repeat_interleave(nums)
        q_pos = starts[q_seq] + _offsets(nums)
        q_blocks = tables[q_seq, q_pos // block_size]
        written = q_pos >= skips[q_seq]
        if bool((q_blocks[written] == 0).any()):
            p = int(q_pos[written][q_blocks[written] == 0][0])
            raise ValueError(f"position {p} would be written into the null block 0")
        q_slots = q_blocks * block_size + q_pos % block_size
        write_slots = q_slots[written]
        write_index = None if bool(written.all()) else written.nonzero().flatten()
        # Keys: each sequence's context [lo, end), packed in batch order.
        lo = torch.zeros_like(starts) if window is None else (starts - window + 1).clamp(min=0)
        kv_lens = ends - lo
        kv_seq = seqs.repeat_interleave(kv_lens)
        kv_pos = lo[kv_seq] + _offsets(kv_lens)
        kv_slots = tables[kv_seq, kv_pos // block_size] * block_size + kv_pos % block_size
        q_pad, kv_pad = bucket(len(q_seq)), bucket(len(kv_seq))
        kv_end = kv_lens.cumsum(0)
        counts, indices = _tile_ranges(q_seq, kv_end - kv_lens, kv_end, q_pad, kv_pad)
        mask = _block_mask(
            _padded(q_seq, q_pad, -2).to(device),
            _padded(q_pos, q_pad, 0).to(device),
            _padded(kv_seq, kv_pad, -1).to(device),
            _padded(kv_pos, kv_pad, 0).to(device),
            torch.tensor(NO_WINDOW if window is None else window, device=device),
            counts.to(device),
            indices.to(device),
        )
        return cls(
            write_slots.to(device),
            None if write_index is None else write_index.to(device),
            _padded(kv_slots, kv_pad, 0).to(device),
            mask,
            window,
        )


def _offsets(lens: torch.Tensor) -> torch.Tensor:
    """0..len-1 for every length, concatenated."""
    total = int(lens.sum())
    firsts = (lens.cumsum(0) - lens).repeat_interleave(lens)
    return torch.arange(total) - firsts


def _padded(values: torch.Tensor, size: int, fill: int) -> torch.Tensor:
    out = torch.full((size,), fill, dtype=values.dtype)
    out[: len(values)] = values
    return out


def _tile_ranges(
    q_seq: torch.Tensor,
    kv_start: torch.Tensor,
    kv_end: torch.Tensor,
    q_pad: int,
    kv_pad: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query tile, the key tiles it visits: from its first sequence's first key to its
    last sequence's last key (contiguous, as both sides are packed in batch order).
    Returns kv_num_blocks [1, 1, q_tiles] and kv_indices [1, 1, q_tiles, kv_tiles]."""
    num_q = len(q_seq)
    first_row = torch.arange(0, q_pad, Q_TILE)
    real = first_row < num_q
    last_row = (first_row + Q_TILE).clamp(max=num_q) - 1
    first_seq = q_seq[first_row.clamp(max=num_q - 1)]
    last_seq = q_seq[last_row.clamp(min=0)]
    lo = kv_start[first_seq] // BLOCK
    hi = -(-kv_end[last_seq] // BLOCK)
    counts = torch.where(real, hi - lo, 0)
    kv_tiles = kv_pad // BLOCK
    indices = (lo[:, None] + torch.arange(kv_tiles)[None, :]).clamp(max=kv_tiles - 1)
    return counts.to(torch.int32)[None, None], indices.to(torch.int32)[None, None]


def _block_mask(
    q_seq: torch.Tensor,
    q_pos: torch.Tensor,
    kv_seq: torch.Tensor,
    kv_pos: torch.Tensor,
    window: torch.Tensor,
    counts: torch.Tensor,
    indices: torch.Tensor,
) -> BlockMask:
    """The step's BlockMask: the visited key tiles (`counts` per query tile, their
    `indices`), `mask_mod` inside them; its tensors live where the kernel runs."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        qp, kp = q_pos[q], kv_pos[k]
        return (q_seq[q] == kv_seq[k]) & (kp <= qp) & (kp > qp - window)

    return BlockMask.from_kv_blocks(
        counts,
        indices,
        BLOCK_SIZE=(Q_TILE, BLOCK),
        mask_mod=mask_mod,
        seq_lengths=(len(q_seq), len(kv_seq)),
        compute_q_blocks=False,
    )
