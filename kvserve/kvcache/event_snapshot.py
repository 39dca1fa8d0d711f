"""Everything a manager holds, as events: what a subscriber that lost the stream rebuilds from.

Call between steps (no pending blocks). The snapshot starts with
`AllBlocksCleared`, then one `BlockStored` per cached hash block that a hit
can still use, the anchor (first full-attention) group first and parents
before children, so applying it like any batch gives the exact view. A block
whose verification link is stale (its parent, or for a sliding window its
full-attention anchor, was evicted and registered anew) can never be hit
again and is left out: advertise only what a hit can use.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any

from kvserve.kvcache.block import ROOT_CACHE_ID, KVBlock
from kvserve.kvcache.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockStored,
    KVEvent,
    wire_hash,
)

if TYPE_CHECKING:
    from kvserve.kvcache.manager import KVCacheManager


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


def _depths(blocks: list[KVBlock]) -> dict[int, int]:
    """cache_id -> chain depth (0: a request's first block); -1 when a parent is gone."""
    by_id = {b.cache_id: b for b in blocks}
    depth: dict[int, int] = {}
    for block in blocks:
        path: list[KVBlock] = []
        node: KVBlock | None = block
        while True:
            if node.cache_id in depth:  # type: ignore[union-attr]
                base = depth[node.cache_id]  # type: ignore[union-attr]
                break
            path.append(node)  # type: ignore[arg-type]
            pid = node.parent_cache_id  # type: ignore[union-attr]
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


def snapshot_events(
    manager: KVCacheManager, int_block_hashes: bool = True, medium: str = MEDIUM_GPU
) -> list[KVEvent]:
    """The manager's cached content as `[AllBlocksCleared, BlockStored...]` (see module doc)."""
    pool = manager.pool
    verify = manager.config.verify_hits
    groups = manager.groups
    anchor = next((g for g in groups if g.kind == "full_attention"), None)
    order = ([anchor] if anchor else []) + [g for g in groups if g is not anchor]
    events: list[KVEvent] = [AllBlocksCleared()]
    anchor_by_id: dict[int, KVBlock] = {}
    anchor_depth: dict[int, int] = {}
    if anchor is not None:
        anchor_blocks = list(pool.index[anchor.group_id].values())
        anchor_by_id = {b.cache_id: b for b in anchor_blocks}
        anchor_depth = _depths(anchor_blocks)

    def hash_of(cache_id: int) -> Any:
        parent = anchor_by_id.get(cache_id)
        return None if parent is None else wire_hash(parent.block_hash, int_block_hashes)  # type: ignore[arg-type]

    for group in order:
        blocks = list(pool.index[group.group_id].values())
        kind, window = group.kind, getattr(group, "window", None)
        chosen: list[tuple[int, KVBlock, Any]] = []
        if group is anchor:
            for b in blocks:
                d = anchor_depth[b.cache_id]
                if d < 0 and verify:
                    continue
                chosen.append((d, b, hash_of(b.parent_cache_id)))
        elif anchor is not None:
            for b in blocks:
                a = anchor_by_id.get(b.parent_cache_id)
                usable = a is not None and a.block_hash == b.block_hash
                if verify and not (usable and anchor_depth[a.cache_id] >= 0):  # type: ignore[union-attr]
                    continue
                parent = hash_of(a.parent_cache_id) if a is not None else None
                chosen.append((0, b, parent))
        else:
            own = {b.cache_id: b for b in blocks}
            for b in blocks:
                p = own.get(b.parent_cache_id)
                chosen.append(
                    (0, b, None if p is None else wire_hash(p.block_hash, int_block_hashes))
                )  # type: ignore[arg-type]
        chosen.sort(key=lambda item: item[0])
        for _, b, parent in chosen:
            salt, lora = parse_extra(b.extra)
            extra = tuple(x for x in (lora, salt) if x is not None)
            events.append(
                BlockStored(
                    block_hashes=[wire_hash(b.block_hash, int_block_hashes)],  # type: ignore[arg-type]
                    parent_block_hash=parent,
                    token_ids=list(b.token_ids or ()),
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
