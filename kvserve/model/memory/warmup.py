"""Warm the kernels at start, so the first requests do not pay for kernel selection.

On CUDA every new tensor shape pays for choosing (and maybe compiling) its
kernels the first time; a process that serves at once would see its first
steps many times slower than later ones. The warm-up runs dummy steps
(kvserve.model.memory.scratch: the pool, the prefix cache and the generators stay
as they were) over a bucketed set of shapes: prefills of growing length and
decodes of growing batch, as a CUDA graph capture would bucket them.

The runner warms up on accelerators only: the CPU chooses no kernels per
shape, and the many engines the tests build must not pay for it there.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from kvserve.model.memory.scratch import dummy_chunks, scratch_cache

logger = logging.getLogger(__name__)

FIRST_PREFILL = 16
DECODE_CONTEXT = 32
"""Positions a dummy decode reads before its own (a couple of blocks)."""


def warmup_shapes(
    max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int
) -> list[tuple[int, int, int]]:
    """(sequences, tokens each, start) of the dummy steps: prefills of 16, 64, 256, ...
    tokens up to the step's token budget (and the model's length), and decodes of 1, 2,
    4, ... sequences up to `max_num_seqs`."""
    longest = min(max_num_batched_tokens, max_model_len)
    context = min(DECODE_CONTEXT, max_model_len - 1)
    widest = min(max_num_seqs, max_num_batched_tokens)
    prefills = _growing(FIRST_PREFILL, longest, 4)
    decodes = _growing(1, widest, 2)
    return [(1, n, 0) for n in prefills] + [(b, 1, context) for b in decodes]


def _growing(first: int, last: int, factor: int) -> list[int]:
    """first, first*factor, ... below `last`, then `last` itself."""
    sizes = []
    size = min(first, last)
    while size < last:
        sizes.append(size)
        size *= factor
    return [*sizes, last]


def warm_up(runner: Any, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Run the dummy steps; logs and returns how many shapes ran."""
    t0 = time.perf_counter()
    shapes = warmup_shapes(max_num_seqs, max_num_batched_tokens, runner.max_model_len)
    with scratch_cache(runner):
        for num_seqs, num_tokens, start in shapes:
            runner.execute(dummy_chunks(runner, num_seqs, num_tokens, start, "warmup"))
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
    logger.info("warm-up: %d shapes in %.2f s", len(shapes), time.perf_counter() - t0)
    return len(shapes)
