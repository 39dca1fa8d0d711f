"""The packed weight layout of `quant_matmul.c`, written and read back with torch.

A row's columns are windows of 16 blocks of 32 (the last may hold fewer). In
a window, lane l holds block l for l < half and block half + l - 8 for l >= 8
(half = blocks in the window / 2), and step t holds columns 4t..4t+3 of each
block: one VNNI instruction then multiplies 4 columns of 16 blocks and keeps
each block's sum in its own lane (the C file's header says why). Per step:

- 8 bits: the low lanes' 4 * half bytes, then the high lanes';
- 4 bits: 4 * half bytes, each a low lane's code | a high lane's code << 4.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

BLOCK = 32
"""Input columns sharing one int8 scale of the activations, and one 4-bit scale."""
WINDOW = 16
"""Blocks per window."""
CHUNK = 64
"""A packed weight's width must be a multiple of this (whole bytes of 4-bit pairs in a
window's lanes)."""


def fits(in_features: int) -> bool:
    """Whether the kernel runs weights of this many input columns."""
    return in_features > 0 and in_features % CHUNK == 0


def windows(in_features: int) -> Iterator[tuple[int, int]]:
    """(first block, blocks) of each window of a row."""
    blocks = in_features // BLOCK
    for first in range(0, blocks, WINDOW):
        yield first, min(WINDOW, blocks - first)


def _steps(codes: torch.Tensor, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A window's codes as [N, steps, lanes, 4], low lanes and high lanes."""
    rows = codes.shape[0]
    window = codes[:, first * BLOCK : (first + count) * BLOCK].reshape(rows, count, 8, 4)
    window = window.permute(0, 2, 1, 3)
    half = count // 2
    return window[:, :, :half], window[:, :, half:]


def check_width(in_features: int) -> None:
    """Refuse, by name, a width the kernel cannot run."""
    if not fits(in_features):
        raise ValueError(
            f"a packed weight needs a multiple of {CHUNK} input columns, got {in_features}"
        )


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [N, K] (0..15 for 4 bits, 0..255 for 8) -> the kernel's uint8 rows."""
    rows, width = codes.shape
    check_width(width)
    codes = codes.to(torch.uint8)
    parts = []
    for first, count in windows(width):
        low, high = _steps(codes, first, count)
        if bits == 4:
            parts.append((low | (high << 4)).reshape(rows, -1))
        else:
            parts.append(torch.cat((low, high), dim=2).reshape(rows, -1))
    return torch.cat(parts, dim=1)


def unpack(packed: torch.Tensor, width: int, bits: int) -> torch.Tensor:
    """The kernel's rows back to codes [N, K] (int32, in column order)."""
    rows = packed.shape[0]
    out = torch.empty(rows, width, dtype=torch.int32)
    at = 0
    for first, count in windows(width):
        half = count // 2
        size = count * BLOCK * bits // 8
        window = packed[:, at : at + size].to(torch.int32)
        at += size
        if bits == 4:
            steps = window.reshape(rows, 8, half, 4)
            lanes = torch.cat((steps & 15, steps >> 4), dim=2)
        else:
            lanes = window.reshape(rows, 8, count, 4)
        block = lanes.permute(0, 2, 1, 3).reshape(rows, count * BLOCK)
        out[:, first * BLOCK : (first + count) * BLOCK] = block
    return out


def packed_columns(in_features: int) -> torch.Tensor:
    """The input column of each position of a row in the packed order (window, step,
    position p: block p // 4 of the window, column 4 * step + p % 4 of the block)."""
    order = []
    for first, count in windows(in_features):
        step = torch.arange(8)[:, None]
        position = torch.arange(4 * count)[None, :]
        order.append(((first + position // 4) * BLOCK + 4 * step + position % 4).reshape(-1))
    return torch.cat(order)
