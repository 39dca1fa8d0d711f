"""The attention metadata of one step: where each new token's K/V is written, what each
sequence reads.

A position p of a sequence lives in flat cache slot block_table[p // block_size] *
block_size + p % block_size (block 0 is the null block and is never written). The
slot indices are built once per step and shared by the layers of one KV cache group
(one metadata per group). A sliding-window group's metadata reads only each query's
window (keys p-W+1..p): the table entries before it may be the null block. A fresh
prefill reads no slots: it attends to its own new k/v directly. Decodes are sorted by
context length and padded in groups of DECODE_GROUP (up to DECODE_GROUP stay one group,
in batch order; all of them with the CPU's paged decode kernel); each row reads its whole
context through its own slots, whether or not its blocks are shared with other rows
(reading a shared prefix once for a group was measured slower on the CPU:
benchmarks/README.md, "Decode over shared prefixes").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch

from kvserve.model.cpu_kernels.attention import kernel as attention_kernel


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
    causal: bool = False
    """The mask is the plain lower triangle (a fresh prefill without a window): SDPA's
    is_causal gives the same bits without reading it and skips the key blocks above the
    diagonal (1.4x faster at 1,000 tokens, 1.9x at 1,500 on the CPU)."""


@dataclass(slots=True)
class DecodeGroup:
    """Single-token sequences of similar context length, attended in one padded call."""

    index: torch.Tensor
    """[B] their positions in the flattened batch."""
    slots: torch.Tensor
    """[B, S] flat cache slots of each context, padded with slot 0 (the null block,
    zeros) up to the group's longest S."""
    mask: torch.Tensor | None
    """[B, 1, 1, S] bool, True for real context, False for padding; None when there is no
    padding (every context in the group equally long)."""
    in_order: bool = False
    """Its rows are consecutive rows of the batch, in batch order."""
    bounds: torch.Tensor | None = None
    """[B, 2] int32: row b's real keys are slots[b, begin:end] (the CPU's paged decode
    kernel reads only those: kvserve.model.cpu_kernels.attention); None where that kernel
    is off."""


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
    """The single-token sequences, in groups of similar context length."""
    window: int | None = None
    """Sliding window of the group's layers (None: full attention)."""
    whole_batch: DecodeGroup | None = None
    """The one decode group when it is the whole batch, rows in batch order (every step of
    a lone decoding request): attended without gathering or scattering rows."""

    @classmethod
    def build(
        cls,
        spans: Sequence[tuple[int, int, Sequence[int], int]],
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
                decodes.append((query_start, end, list(table[:needed])))
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
                causal = fresh and window is None
                prefills.append(SeqSpan(query_start, num, end - lo, read, mask[:, lo:], causal))
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
        whole = groups[0] if not prefills and len(groups) == 1 and groups[0].in_order else None
        return cls(slot_tensor, index, prefills, groups, window, whole)


def _slots(table: Sequence[int], end: int, block_size: int, device: torch.device) -> torch.Tensor:
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


def _decode_groups(
    decodes: list[tuple[int, int, list[int]]],
    block_size: int,
    device: torch.device,
    window: int | None = None,
) -> list[DecodeGroup]:
    """(batch position, context length, block table) per decode -> padded groups of
    DECODE_GROUP sorted by context length; at most DECODE_GROUP decodes stay one group in
    batch order (sorting them would group nothing, and the rows of a whole-batch group
    need no gathering out of the batch and no scattering back). One padded group of 64
    rows of similar lengths was measured slower than four sorted ones (96 against 88 ms
    a step, benchmarks/profile_step.py). With the CPU's paged decode kernel enabled every
    decode is one group in batch order: it reads no padding, and the rows need no gather
    and scatter (a 64-row step 83 -> 80 ms)."""
    paged = device.type == "cpu" and attention_kernel() is not None
    plain = _decode_group if window is None else partial(_window_decode_group, window=window)
    build = partial(plain, paged=paged)
    if len(decodes) <= DECODE_GROUP or paged:
        return [build(decodes, block_size=block_size, device=device)] if decodes else []
    ordered = sorted(decodes, key=lambda d: d[1])
    return [
        build(ordered[i : i + DECODE_GROUP], block_size=block_size, device=device)
        for i in range(0, len(ordered), DECODE_GROUP)
    ]


def _decode_group(
    part: list[tuple[int, int, list[int]]],
    block_size: int,
    device: torch.device,
    paged: bool = False,
) -> DecodeGroup:
    """One group: each decode reads keys 0 .. n - 1 (padding: null slot 0)."""
    tables = _padded_tables(part, device)
    lengths = [n for _, n, _ in part]
    lens = torch.tensor(lengths, dtype=torch.long, device=device)
    pos = torch.arange(max(lengths), device=device)
    valid = pos[None, :] < lens[:, None]
    slots = tables[:, pos // block_size] * block_size + pos % block_size
    padded = min(lengths) < max(lengths)
    return DecodeGroup(
        _rows(part, device),
        slots.masked_fill_(~valid, 0) if padded else slots,
        valid[:, None, None, :] if padded else None,
        _in_order(part),
        _bounds([(0, n) for n in lengths], device) if paged else None,
    )


def _window_decode_group(
    part: list[tuple[int, int, list[int]]],
    block_size: int,
    device: torch.device,
    window: int,
    paged: bool = False,
) -> DecodeGroup:
    """Each decode at position n - 1 reads only keys n - W .. n - 1 (padding: null slot 0)."""
    tables = _padded_tables(part, device)
    lengths = [n for _, n, _ in part]
    lens = torch.tensor(lengths, dtype=torch.long, device=device)
    span = min(window, max(lengths))
    pos = lens[:, None] - span + torch.arange(span, device=device)[None, :]
    valid = pos >= 0
    pos = pos.clamp_(min=0)
    slots = tables.gather(1, pos // block_size) * block_size + pos % block_size
    padded = min(lengths) < span
    return DecodeGroup(
        _rows(part, device),
        slots.masked_fill_(~valid, 0) if padded else slots,
        valid[:, None, None, :] if padded else None,
        _in_order(part),
        _bounds([(max(0, span - n), span) for n in lengths], device) if paged else None,
    )


def _padded_tables(part: list[tuple[int, int, list[int]]], device: torch.device) -> torch.Tensor:
    """[B, widest] block tables of a group, padded with the null block 0."""
    width = max(len(t) for _, _, t in part)
    return torch.tensor(
        [t + [0] * (width - len(t)) for _, _, t in part], dtype=torch.long, device=device
    )


def _rows(part: list[tuple[int, int, list[int]]], device: torch.device) -> torch.Tensor:
    """The batch rows of a group's decodes."""
    return torch.tensor([q for q, _, _ in part], dtype=torch.long, device=device)


def _bounds(pairs: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """[B, 2] int32 (begin, end) of each row's real keys within its padded slots."""
    return torch.tensor(pairs, dtype=torch.int32, device=device)


def _in_order(part: list[tuple[int, int, list[int]]]) -> bool:
    first = part[0][0]
    return [q for q, _, _ in part] == list(range(first, first + len(part)))


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
