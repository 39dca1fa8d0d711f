"""Everything a manager holds, as events: what a subscriber that lost the stream rebuilds from.

Call between steps (no pending blocks). The snapshot starts with
`AllBlocksCleared`, then one `BlockStored` per cached hash block that a hit
can still use, the anchor (first full-attention) group first and parents
before children, so applying it like any batch gives the exact view.

Index values are KVBlocks, or CacheEntries (one per hash block of an inflated
attention block in hybrid state models); both carry the hash, tokens, extra
keys and verification link this needs. Full-attention groups chain to their
own parent; sliding-window blocks and state snapshots are anchored to the
anchor group's entry at the same hash. A block whose verification link is
stale (its parent chain, or its anchor and the anchor's chain, was evicted
and registered anew) can never be hit again and is left out: advertise only
what a hit can use.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any

from kvserve.kvcache.block import ROOT_CACHE_ID
from kvserve.kvcache.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockStored,
    KVEvent,
    wire_hash,
)
from kvserve.kvcache.hashing import unpack_tokens

if TYPE_CHECKING:
    from kvserve.kvcache.manager import KVCacheManager

Cached = Any
"""A KVBlock or a CacheEntry: block_hash, token_ids, extra, parent_cache_id, cache_id."""


def parse_extra(extra: bytes) -> tuple[str | None, str | None]:
    """(cache salt, LoRA name) back from `hashing.extra_key_bytes`'s encoding."""
    salt = lora = None
    pos = 0
    while pos < len(extra):
        tag = extra[pos : pos + 1]
        (size,) = struct.unpack_from("<I", extra, pos + 1)
        value = extra[pos + 5 : pos + 5 + size].decode()
        pos += 5 + size
        if tag == b"S":
            salt = value
        else:
            lora = value
    return salt, lora


_STALE = -2


def _depths(blocks: list[Cached]) -> dict[int, int]:
    """cache_id -> chain depth (0: a request's first block); -1 when a parent is gone."""
    by_id = {b.cache_id: b for b in blocks}
    depth: dict[int, int] = {}
    for block in blocks:
        path: list[Cached] = []
        node = block
        while True:
            if node.cache_id in depth:
                base = depth[node.cache_id]
                break
            path.append(node)
            pid = node.parent_cache_id
            if pid == ROOT_CACHE_ID:
                base = -1
                break
            node = by_id.get(pid)
            if node is None:
                base = _STALE
                break
        for n in reversed(path):
            base = _STALE if base == _STALE else base + 1
            depth[n.cache_id] = base
    return {cid: (d if d >= 0 else -1) for cid, d in depth.items()}


class _Chain:
    """One chained group's cached blocks by registration, with their depths."""

    def __init__(self, blocks: list[Cached]) -> None:
        self.blocks = blocks
        self.by_id = {b.cache_id: b for b in blocks}
        self.depth = _depths(blocks)

    def hash_of(self, cache_id: int, int_block_hashes: bool) -> Any:
        """The wire hash of registration `cache_id`, None when it is not cached."""
        b = self.by_id.get(cache_id)
        return None if b is None else wire_hash(b.block_hash, int_block_hashes)


def snapshot_events(
    manager: KVCacheManager, int_block_hashes: bool = True, medium: str = MEDIUM_GPU
) -> list[KVEvent]:
    """The manager's cached content as `[AllBlocksCleared, BlockStored...]` (see module doc)."""
    index = manager.pool.index
    verify = manager.config.verify_hits
    groups = manager.groups
    anchor = next((g for g in groups if g.kind == "full_attention"), None)
    order = ([anchor] if anchor else []) + [g for g in groups if g is not anchor]
    anchor_chain = _Chain(list(index[anchor.group_id].values())) if anchor else None
    events: list[KVEvent] = [AllBlocksCleared()]
    for group in order:
        blocks = list(index[group.group_id].values())
        chosen: list[tuple[int, Cached, Any]] = []
        if group.kind == "full_attention" or anchor_chain is None:
            chain = anchor_chain if group is anchor and anchor_chain is not None else _Chain(blocks)
            # Without an anchor, window blocks are verified by tokens only: keep them all.
            check = verify and group.kind == "full_attention"
            for b in blocks:
                d = chain.depth[b.cache_id]
                if d < 0 and check:
                    continue
                parent = chain.hash_of(b.parent_cache_id, int_block_hashes)
                chosen.append((d, b, parent))
        else:
            for b in blocks:
                a = anchor_chain.by_id.get(b.parent_cache_id)
                usable = (
                    a is not None
                    and a.block_hash == b.block_hash
                    and anchor_chain.depth[a.cache_id] >= 0
                )
                if verify and not usable:
                    continue
                parent = (
                    None if a is None else anchor_chain.hash_of(a.parent_cache_id, int_block_hashes)
                )
                chosen.append((0, b, parent))
        chosen.sort(key=lambda item: item[0])
        kind, window = group.kind, getattr(group, "window", None)
        for _, b, parent in chosen:
            salt, lora = parse_extra(b.extra)
            extra = tuple(x for x in (lora, salt) if x is not None)
            events.append(
                BlockStored(
                    block_hashes=[wire_hash(b.block_hash, int_block_hashes)],
                    parent_block_hash=parent,
                    token_ids=unpack_tokens(b.token_ids or b""),
                    block_size=manager.block_size,
                    lora_id=None,
                    medium=medium,
                    lora_name=lora,
                    extra_keys=[extra] if extra else None,
                    group_idx=group.group_id,
                    kv_cache_spec_kind=kind,
                    kv_cache_spec_sliding_window=window,
                )
            )
    return events
