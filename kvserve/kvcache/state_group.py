"""Mamba-style state groups: one running state per request plus cached snapshots.

A recurrent layer's state after token t summarises everything before it, so
there is nothing per token to share: a prefix hit must resume from a
snapshot of the state at exactly that position. Snapshots are taken when an
attention block fills (every `block_size` tokens, vLLM's "align" mode) and at
the last hash-block boundary of each prompt, so a repeated or extended
prompt (the next chat turn) resumes from it even when it is shorter than one
physical block. Snapshot pages live in the shared pool like any cached block
(evictable, LRU) but their number is bounded by a share of the pool.

A request's table in this group is one page: its running state. Pages used
only during one step (the snapshot a hit resumes from, snapshots being
written) are held as the request's `transient` blocks and released when the
step ends.
"""

from __future__ import annotations

from typing import cast

from kvserve.kvcache.block import CacheEntry, KVBlock
from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.sequence import CacheSequence
from kvserve.kvcache.specs import MambaStateSpec


class MambaStateGroup:
    """Per request: a running-state page; in the index: snapshot pages by hash."""

    __slots__ = (
        "block_size",
        "group_id",
        "hash_block_size",
        "index",
        "max_snapshots",
        "pool",
        "spec",
        "verify",
    )

    kind = "mamba"

    def __init__(
        self,
        group_id: int,
        spec: MambaStateSpec,
        pool: BlockPool,
        verify: bool,
        hash_block_size: int,
        max_snapshots: int,
    ) -> None:
        self.group_id = group_id
        self.spec = spec
        self.block_size = spec.block_size
        self.hash_block_size = hash_block_size
        self.pool = pool
        self.index = cast("dict[bytes, KVBlock]", pool.index[group_id])
        self.verify = verify
        self.max_snapshots = max_snapshots

    def _verified(self, seq: CacheSequence, c: int, anchors: list[CacheEntry]) -> KVBlock | None:
        """The snapshot after hash block c-1 of `seq`, if it is really this prefix's."""
        page = self.index.get(seq.block_hashes[c - 1])
        if page is None or not self.verify:
            return page
        hb = self.hash_block_size
        i = c - 1
        if (
            page.parent_cache_id != anchors[i].cache_id
            or page.token_ids != seq.packed_blocks(i, i + 1, hb)
            or page.extra != (seq.extra_keys[1] if i else seq.extra_keys[0])
        ):
            return None
        return page

    def usable(
        self, seq: CacheSequence, candidate: int, anchors: list[CacheEntry]
    ) -> tuple[int, bool]:
        """Largest c <= candidate with a computed snapshot, and whether waiting helps.

        A snapshot written in this very step cannot be read before the step
        runs (design.md invariant 8): the request waits one step instead.
        """
        wait = False
        for c in range(min(candidate, len(anchors)), 0, -1):
            page = self._verified(seq, c, anchors)
            if page is None:
                continue
            if page.computed:
                return c, wait
            wait = True
        return 0, wait

    def hit_page(self, seq: CacheSequence, c: int) -> KVBlock:
        return self.index[seq.block_hashes[c - 1]]

    def num_new_blocks(self, seq: CacheSequence, num_tokens: int, num_hit: int) -> int:
        """A running-state page, once."""
        return 0 if seq.kv_blocks[self.group_id] else 1

    def max_blocks_held(self, num_tokens: int, max_chunk_tokens: int | None) -> int:
        """The running state and the snapshot a hit resumes from."""
        return 2

    def snapshot_positions(self, seq: CacheSequence, start: int, end: int) -> list[int]:
        """Positions in (start, end] after which to keep the state (see `may_snapshot`).

        Physical-block fills, plus the prompt's last hash-block boundary (the
        longest prefix a repeat of this prompt can resume from, since its last
        token is always recomputed).
        """
        bs = self.block_size
        hb = self.hash_block_size
        positions = list(range((start // bs + 1) * bs, end + 1, bs))
        last = (len(seq.token_ids) - 1) // hb * hb
        if start < last <= end and last % bs:
            positions.append(last)
            positions.sort()
        return [p for p in positions if p // hb <= len(seq.block_hashes)]

    def may_snapshot(self, seq: CacheSequence, position: int, anchor: CacheEntry) -> bool:
        """No usable snapshot of this prefix exists yet (one is never stored twice).

        A cached snapshot whose anchor was evicted and registered anew can
        never verify again: it is dropped so a fresh one takes its place.
        """
        page = self.index.get(seq.block_hashes[position // self.hash_block_size - 1])
        if page is None:
            return True
        if page.parent_cache_id == anchor.cache_id or page.ref_cnt or not page.computed:
            return False
        self.pool.uncache(page)
        return True

    def make_room(self) -> bool:
        """Keep snapshots within their share: drop the least recently cached free one."""
        index = self.index
        if len(index) < self.max_snapshots:
            return True
        for page in index.values():  # insertion order: oldest first
            if page.ref_cnt == 0 and page.computed:
                self.pool.uncache(page)
                return True
        return False

    def register_snapshot(
        self, seq: CacheSequence, position: int, page: KVBlock, anchor: CacheEntry
    ) -> None:
        hb = self.hash_block_size
        i = position // hb - 1
        block_tokens = seq.packed_blocks(i, i + 1, hb)
        extra = seq.extra_keys[1] if i else seq.extra_keys[0]
        hashes = [seq.block_hashes[i]]
        self.pool.register_run(
            self.group_id, [page], hashes, block_tokens, extra, extra, anchor.cache_id
        )
        events = self.pool.events
        if events is not None:
            events.stored(self.group_id, seq, i, seq.token_ids[i * hb : (i + 1) * hb])

    def touch_hit(self, page: KVBlock) -> None:
        """A hit moves its snapshot to the young end of the share (LRU)."""
        index = self.index
        block_hash = page.block_hash
        assert block_hash is not None, "a hit is cached"
        index[block_hash] = index.pop(block_hash)
