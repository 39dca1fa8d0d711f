"""Draw one token per row from its probabilities: the inverse of the cumulative
distribution at one uniform number per row.

Why not the exponential race (argmax p / E, E ~ Exp(1)) the sampler used before: it
needs a random number per vocabulary entry, and torch's CPU `exponential_` makes them
at about 20 ns each, serially: 1 ms a row for a 49,152-token vocabulary, 8 ms of a
35 ms decode step of 8 requests (measured, benchmarks/README.md). The inverse CDF
takes one uniform per row and cumulative sums (`pick`), 0.03 ms a row. The sums run in
float64, so a token keeps its chance unless it is below about 1e-16 of the mass
before it (in float32 that would be 3e-8, and a long tail of such tokens could lose
part of its share).

Each row's uniform comes from that request's own generator when it has one, so a
seeded request draws the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import torch


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """[N] token ids drawn from `probs` [N, vocab] (entries >= 0; a row need not sum to
    1: each is drawn in proportion to its entries)."""
    device = probs.device
    uniforms = torch.rand(probs.shape[0], 1, dtype=torch.float64, device=device)
    for i, generator in enumerate(generators):  # a seeded row: its own stream
        if generator is not None:
            uniforms[i] = torch.rand(1, generator=generator, dtype=torch.float64, device=device)
    return pick(probs, uniforms)


BLOCK = 256
"""Vocabulary entries per block of the two-level search."""


def pick(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The first index whose cumulative mass exceeds u times the row's total: a token of
    zero probability adds nothing to the sum, so it is never the first to exceed it.

    In two levels, both in float64: the block of BLOCK entries where the cumulative sum
    of block totals crosses the threshold, then the entry within it. A cumulative sum
    over the whole vocabulary runs serially (1.3 ms for 8 rows of 49,152 here); block
    totals are a vectorised reduction. `probs` [N, vocab], `uniforms` [N, 1] in [0, 1).
    """
    rows, vocab = probs.shape
    if vocab % BLOCK:  # zeros at the end: never picked
        probs = torch.nn.functional.pad(probs, (0, BLOCK - vocab % BLOCK))
    blocks = probs.view(rows, -1, BLOCK)
    block_cumulative = blocks.sum(-1, dtype=torch.float64).cumsum(-1)
    total = block_cumulative[:, -1:]
    # u * total may round up to total itself: keep the threshold strictly below it, so
    # some index (the last token with mass) always exceeds it.
    threshold = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(block_cumulative, threshold, right=True)  # [N, 1]
    edges = torch.nn.functional.pad(block_cumulative, (1, 0))  # mass before each block
    before = edges.gather(1, block)
    chosen = blocks.gather(1, block[:, :, None].expand(rows, 1, BLOCK))[:, 0]
    within_cumulative = chosen.cumsum(-1, dtype=torch.float64)
    within = torch.searchsorted(within_cumulative, threshold - before, right=True)
    # The block's own sum may round a hair below its total: stay inside the block.
    return (block * BLOCK + within.clamp_(max=BLOCK - 1)).squeeze(1)
