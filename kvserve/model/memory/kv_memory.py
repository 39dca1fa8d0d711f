"""Size and allocate the paged K/V tensors of every layer."""

from __future__ import annotations

import logging
import os

import torch

from kvserve.model.checkpoint.config import ModelConfig

logger = logging.getLogger(__name__)

GiB = 1 << 30
CPU_FRACTION = 0.25
CPU_CAP = 4 * GiB


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K plus V bytes of one block over all layers."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element


def cpu_kv_cache_memory() -> int:
    """The CPU's default budget: min(25% of available RAM, 4 GiB), so the pool leaves the
    machine room for everything else (CUDA is sized by kvserve.model.memory.pool_size)."""
    return min(int(available_ram() * CPU_FRACTION), CPU_CAP)


def gpu_kv_cache_memory(
    *, total: int, in_use: int, activation_peak: int, utilization: float, block_bytes: int
) -> int:
    """The KV pool's bytes on an accelerator: `utilization` of its `total` memory, less what
    is `in_use` already (weights, other pools, other processes) and the profiled
    `activation_peak` of the largest step.

    Of the total rather than of what is free, so the pool does not depend on
    what happened to be free; a budget under 2 blocks is a one-line ValueError
    naming gpu_memory_utilization and the numbers.
    """
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    budget = int(total * utilization) - in_use - activation_peak
    if budget < 2 * block_bytes:
        raise ValueError(
            f"gpu_memory_utilization {utilization} of {total / GiB:.2f} GiB leaves "
            f"{max(budget, 0) / GiB:.2f} GiB for the KV cache after {in_use / GiB:.2f} GiB "
            f"in use and a {activation_peak / GiB:.2f} GiB activation peak: fewer than 2 "
            f"blocks of {block_bytes} bytes (raise gpu_memory_utilization, lower "
            "max_num_batched_tokens, or give kv_cache_memory)"
        )
    return budget


def available_ram() -> int:
    """MemAvailable from /proc/meminfo, or free physical pages where that is missing."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return GiB


def num_blocks_for(memory: int, block_bytes: int) -> int:
    """Blocks that fit in `memory` bytes; at least 2 are needed (block 0 is the null block)."""
    num = memory // block_bytes
    if num < 2:
        raise ValueError(
            f"KV cache memory of {memory} bytes holds {num} blocks of {block_bytes} bytes; "
            "at least 2 are needed (block 0 is the null block)"
        )
    return num


def allocate_kv_caches(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    num_tensors: int | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`num_tensors` (default: one per layer) (K, V) pairs, each [num_blocks,
    block_size, kv_heads, head_dim].

    Left uninitialised (zeroing gigabytes up front costs seconds and commits
    all the memory at once); readers only use slots that were written or mask
    the rest. The null block is zeroed since padded reads point at it.
    """
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    caches = []
    for _ in range(config.num_layers if num_tensors is None else num_tensors):
        k = torch.empty(shape, dtype=dtype, device=device)
        v = torch.empty(shape, dtype=dtype, device=device)
        k[0].zero_()
        v[0].zero_()
        caches.append((k, v))
    return caches
