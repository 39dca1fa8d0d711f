"""Random attention steps over shuffled paged blocks, run through several attention
backends from the same cache: what the backend tests compare."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from kvserve.model.attention.plain import paged_attention

BS, KV_HEADS, HEADS, DIM = 4, 2, 4, 16
NUM_BLOCKS = 160
CPU = torch.device("cpu")


def random_step(
    seed: int, prefill: int, chunk: tuple[int, int], decodes: list[int], block_size: int = BS
):
    """Spans (start, num, table, skip) of one step over shuffled blocks: a fresh prefill of
    `prefill` tokens, its fully cached twin (reads what the prefill writes, writes
    nothing), a chunk (start, num) after cached context, and decodes at the given
    context lengths whose tables share their first 4 blocks (a shared prompt)."""
    rng = random.Random(seed)
    free = list(range(1, NUM_BLOCKS))
    rng.shuffle(free)

    def blocks(n: int) -> list[int]:
        return [free.pop() for _ in range(-(-n // block_size))]

    shared = blocks(4 * block_size)
    spans = []
    first = blocks(prefill)
    spans.append((0, prefill, first, 0))
    start, num = chunk
    spans.append((start, num, blocks(start + num), 0))
    for length in decodes:
        spans.append((length - 1, 1, shared + blocks(length - 4 * block_size), 0))
    spans.append((0, prefill, first, prefill))
    rng.shuffle(spans)
    return spans


def run_paths(
    builders: Sequence[Callable],
    spans,
    window=None,
    softcap=None,
    seed=0,
    *,
    block_size: int = BS,
    heads: int = HEADS,
    kv_heads: int = KV_HEADS,
    dim: int = DIM,
    dtype: torch.dtype = torch.float32,
):
    """(outputs, caches after the step) of each metadata builder's path, all from the same
    random cache (its null block zero) and the same q/k/v."""
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(NUM_BLOCKS, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(NUM_BLOCKS, block_size, kv_heads, dim, generator=gen).to(dtype)
    k_cache[0] = v_cache[0] = 0  # the null block
    tokens = sum(num for _, num, _, _ in spans)
    q = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    k = torch.randn(tokens, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(tokens, kv_heads, dim, generator=gen).to(dtype)
    results = []
    for build in builders:
        caches = k_cache.clone(), v_cache.clone()
        meta = build(spans, block_size, CPU, window)
        with torch.inference_mode():  # as the runner calls it (one compiled variant)
            out = paged_attention(q, k, v, *caches, meta, dim**-0.5, softcap)
        results.append((out, caches))
    return results
