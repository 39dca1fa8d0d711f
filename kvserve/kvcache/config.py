"""What the KV cache manager needs to know; the engine and `simulate` fill it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvserve.kvcache.hashing import DEFAULT_HASH, DEFAULT_SEED
from kvserve.kvcache.specs import KVCacheSpec


@dataclass(slots=True)
class KVCacheConfig:
    """Pool size, hash block size, hashing and the groups' specs."""

    num_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = True
    hash_fn: str | Callable[[bytes], bytes] = DEFAULT_HASH
    hash_seed: int = DEFAULT_SEED
    verify_hits: bool = True
    """Compare a hit's token ids before using it (a collision becomes a miss)."""
    specs: list[KVCacheSpec] | None = None
    """One spec per group; default: one full-attention group. With state groups,
    attention block sizes are multiples of `block_size` (kvcache.specs.inflate_for_state)."""
    state_snapshot_share: float = 0.25
    """Most of the pool that cached state snapshots may take (state groups only)."""
