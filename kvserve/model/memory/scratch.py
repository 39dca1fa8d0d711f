"""Dummy steps on a scratch cache, for the warm-up and the activation profile.

They run the runner's real step (metadata, model, sampler) so that every
kernel a real step launches runs, but on a few zeroed blocks swapped in for
the pool: the pool's contents, the KV cache manager (prefix cache, events)
and the per-request generators are never touched. Every block id of a dummy
chunk is 1, the scratch block; many requests writing the same slots is fine,
as nobody reads what they wrote.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kvserve.batch import SeqChunk
from kvserve.kvcache.plan import StatePlan, StepPlan
from kvserve.sampling_params import SamplingParams

SCRATCH_BLOCK = 1
RANDOM_ROW = SamplingParams(temperature=0.8, top_p=0.95, top_k=20, min_p=0.01)
"""The sampling of one row per dummy step, so the random path's kernels run too."""


@contextmanager
def scratch_cache(runner: Any, num_blocks: int = 2) -> Iterator[None]:
    """The runner steps on `num_blocks` zeroed blocks (block 0, the null block, and the
    scratch block) inside the body; its own K/V, whatever it was, comes back after."""
    saved = runner.kv_tensors, runner.kv_caches, runner.num_blocks
    tensors, caches = runner.allocate_pool(num_blocks)
    for k, v in tensors:
        k.zero_()
        v.zero_()
    runner.kv_tensors, runner.kv_caches, runner.num_blocks = tensors, caches, num_blocks
    try:
        yield
    finally:
        runner.kv_tensors, runner.kv_caches, runner.num_blocks = saved


def dummy_chunks(
    runner: Any, num_seqs: int, num_tokens: int, start: int = 0, tag: str = "dummy"
) -> list[SeqChunk]:
    """`num_seqs` requests computing `num_tokens` tokens each from position `start`
    (start 0: a prefill from a zero state; start > 0 reads `start` earlier positions and
    the scratch state page). All sample; the first row samples at random with a
    generator of its own, the others greedily."""
    end = start + num_tokens
    table = (SCRATCH_BLOCK,) * -(-end // runner.block_size)
    tables = tuple(table for _ in runner.kv_cache_specs)
    states = None
    if runner.state_groups:
        state_in = SCRATCH_BLOCK if start else 0
        states = tuple(
            StatePlan(state_in, SCRATCH_BLOCK) if g in runner.state_groups else None
            for g in range(len(runner.kv_cache_specs))
        )
    tokens = [0] * end
    generator = torch.Generator(device=runner.device)
    generator.manual_seed(0)
    chunks = []
    for i in range(num_seqs):
        rid = f"{tag}-{i}"
        plan = StepPlan(rid, tables, start, num_tokens, state_plans=states)
        chunks.append(
            SeqChunk(rid, tokens, plan, params=RANDOM_ROW if i == 0 else None, generator=generator)
        )
    return chunks
