"""A physical KV block, and a hash block cached inside a larger one (inflated groups)."""

from __future__ import annotations

from dataclasses import dataclass

ROOT_CACHE_ID = -1
"""Parent cache id of a first block: the chain starts at the hasher's root."""


@dataclass(slots=True, eq=False)
class KVBlock:
    """One page of the pool.

    While cached, `block_hash` keys it in its group's index and the fields
    below let a hit be verified: its tokens, its extra keys and the
    registration (`cache_id`) of the parent it was chained to. Verifying the
    parent's registration, not just its hash, is what makes a collision
    anywhere up the chain a miss rather than a wrong hit.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    group: int = -1
    token_ids: bytes | None = None
    """Its tokens as hashed (hashing.pack_tokens): bytes, which the garbage collector
    never scans (a tuple of ints costs a visit per token in the collection after it)."""
    extra: bytes = b""
    parent_cache_id: int = 0
    cache_id: int = 0
    """Unique per registration; 0 while not cached."""
    computed: bool = False
    """False while pending: registered, filled by the step being scheduled."""
    entries: list[CacheEntry] | None = None
    """Inflated attention blocks: the hash blocks inside it that are cached
    (the fields above stay empty; each entry is keyed in the index instead)."""

    @property
    def is_cached(self) -> bool:
        return self.block_hash is not None


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
    token_ids: bytes
    """Packed, as KVBlock.token_ids."""
    extra: bytes
    parent_cache_id: int
    cache_id: int
    computed: bool = False
    """False while the step that fills it is being scheduled (copying from it must wait)."""
