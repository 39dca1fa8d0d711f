"""A hash block cached inside a larger physical block (inflated attention groups)."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.kvcache.block import KVBlock


@dataclass(slots=True, eq=False)
class CacheEntry:
    """Index entry for hash block `slot` of physical block `block`.

    With inflated blocks, prefix matching and events stay at hash-block
    granularity: each hash block gets its own entry, verified like a KVBlock
    (tokens, extra keys, the parent's registration). Evicting the physical
    block removes all of its entries.
    """

    block: KVBlock
    slot: int
    block_hash: bytes
    group: int
    token_ids: list[int] | tuple[int, ...]
    extra: bytes
    parent_cache_id: int
    cache_id: int
    computed: bool = False
    """False while the step that fills it is being scheduled (copying from it must wait)."""
