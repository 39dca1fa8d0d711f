"""Per-group managers: how one kind of layer finds hits and needs blocks.

The coordinator (manager.py) asks each group the same questions; a sliding
window group answers them differently from full attention without touching
the pool. Verification anchors: a sliding-window block cannot be chained to
its left neighbour (that one may be gone), so it records the registration of
the full-attention block at the same position and a hit must match it.
"""

from __future__ import annotations

from typing import cast

from kvserve.kvcache.block import ROOT_CACHE_ID, KVBlock
from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.sequence import CacheSequence
from kvserve.kvcache.specs import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec


class FullAttentionGroup:
    """Full attention: a hit is the longest run of cached blocks from the left."""

    __slots__ = ("block_size", "group_id", "index", "pool", "spec", "verify")

    kind = "full_attention"

    def __init__(
        self,
        group_id: int,
        spec: FullAttentionSpec | SlidingWindowSpec,
        pool: BlockPool,
        verify: bool,
    ) -> None:
        self.group_id = group_id
        self.spec = spec
        self.block_size = spec.block_size
        self.pool = pool
        self.index = cast("dict[bytes, KVBlock]", pool.index[group_id])
        self.verify = verify

    def find_hit(
        self,
        seq: CacheSequence,
        start: int,
        max_blocks: int,
        anchors: list[KVBlock] | None = None,
    ) -> list[KVBlock]:
        """Cached blocks `start, start+1, ...` (at most up to `max_blocks`).

        With verification on, a block only counts if it holds exactly this
        request's tokens and extra keys and was chained to the very block hit
        just before it: a hash collision is a miss, never a wrong hit.
        """
        hashes = seq.block_hashes
        index_get = self.index.get
        hit: list[KVBlock] = []
        if not self.verify:
            for i in range(start, max_blocks):
                block = index_get(hashes[i])
                if block is None:
                    break
                hit.append(block)
            return hit
        held = seq.kv_blocks[self.group_id]
        parent = held[start - 1].cache_id if start else ROOT_CACHE_ID
        width = 4 * self.block_size
        packed = seq.packed_through(max_blocks, self.block_size)
        first_extra, other_extra = seq.extra_keys
        for i in range(start, max_blocks):
            block = index_get(hashes[i])
            if (
                block is None
                or block.parent_cache_id != parent
                or block.token_ids != bytes(packed[i * width : (i + 1) * width])
                or block.extra != (other_extra if i else first_extra)
            ):
                break
            hit.append(block)
            parent = block.cache_id
        return hit

    def find_window_hit(
        self,
        seq: CacheSequence,
        start: int,
        candidate: int,
        anchors: list[KVBlock] | None,
    ) -> tuple[int, list[KVBlock]]:
        """As a non-anchor group (a second full-attention group): its own run from the left."""
        found = self.find_hit(seq, start, candidate)
        return start + len(found), found

    def num_new_blocks(
        self, seq: CacheSequence, num_tokens: int, num_hit: int, first: int = 0
    ) -> int:
        """Blocks to take from the pool so `num_tokens` tokens have slots (`first`: the
        first position the step computes; only a sliding window reads it)."""
        return -(-num_tokens // self.block_size) - len(seq.kv_blocks[self.group_id]) - num_hit

    def pad_window(self, seq: CacheSequence, first: int) -> None:
        """Full attention holds every block: nothing before `first` is left out."""

    def remove_skipped(self, seq: CacheSequence, num_computed_tokens: int) -> None:
        """Full attention keeps every block."""

    def max_blocks_held(self, num_tokens: int, max_chunk_tokens: int | None) -> int:
        """Most blocks one request of `num_tokens` tokens holds at once in this group."""
        return -(-num_tokens // self.block_size)

    def cache_full_blocks(
        self, seq: CacheSequence, start: int, end: int, anchors: list[int] | None = None
    ) -> list[int]:
        """Register blocks `start..end-1` (all of whose tokens are scheduled).

        A block whose content another block already holds is not registered:
        the cached copy is touched and queued in `seq.merges`, to replace ours
        after the step, so identical content is never held twice. Returns the
        registration id now standing for each block (0 once the chain broke):
        the anchors other groups verify against.
        """
        return self._register(seq, start, end, None, self._parent_of(seq, start))

    def _parent_of(self, seq: CacheSequence, start: int) -> int:
        """The registration block `start` chains to: that of the block before it as it
        stands after this step's late merges.

        A merge queued in this step swaps in the cached copy only at `end_step`;
        blocks that accepted drafts fill are registered before that
        (`accept_tokens`), and must chain to the copy, exactly as the next
        step's allocation would. Chained to the request's own unregistered
        block, an identical sequence's blocks looked like a collision: never
        merged (a duplicate held) and never indexed (a later hit short).
        """
        if not start:
            return ROOT_CACHE_ID
        for group_id, i, copy in seq.merges:
            if i == start - 1 and group_id == self.group_id:
                return copy.cache_id
        return seq.kv_blocks[self.group_id][start - 1].cache_id

    def _register(
        self,
        seq: CacheSequence,
        start: int,
        end: int,
        anchors: list[int] | None,
        parent: int,
        chained: bool = True,
    ) -> list[int]:
        """Register blocks `start..end-1`, each chained to `parent` (the block before
        it), or verified against `anchors[i - start]` when anchors are given.

        `chained` False: the group's hits never check a parent (windows alone: the
        block before may be gone), so a cached copy with the same hash, tokens and
        extra keys is the same content whatever registration it was chained to."""
        pool = self.pool
        index = self.index
        group_id = self.group_id
        verify = self.verify
        held = seq.kv_blocks[group_id]
        hashes = seq.block_hashes
        tokens = seq.token_ids
        bs = self.block_size
        packed, width = seq.packed_through(end, bs), 4 * bs  # the tokens as hashed
        first_extra, other_extra = seq.extra_keys
        events = pool.events
        ids: list[int] = []
        i = start
        while i < end:
            if anchors is not None:
                parent = anchors[i - start]
                if not parent:
                    seq.cache_chain_broken = True
                    break
            block_hash = hashes[i]
            existing = index.get(block_hash)
            if existing is not None and (
                existing.parent_cache_id != parent
                and existing.ref_cnt == 0
                and existing.computed
                and verify
                and chained
            ):
                # Stale: its parent was evicted and registered anew (one registration
                # per hash), so it can never verify again. Ours takes its place.
                pool.uncache(existing)
                existing = None
            if existing is None:
                # New content, usually a long run of it (a prompt's blocks): one call,
                # which stops at the first hash already indexed (handled below, next turn).
                j = end if anchors is None else i + 1  # windows verify block by block
                # The tokens as hashed (bytes): the collector never scans cached blocks.
                run_tokens = bytes(packed[i * width : j * width])
                j = i + pool.register_run(
                    group_id,
                    held[i:j],
                    hashes[i:j],
                    run_tokens,
                    other_extra if i else first_extra,
                    other_extra,
                    parent,
                )
                parent = held[j - 1].cache_id
                if events is not None:
                    events.stored(group_id, seq, i, tokens[i * bs : j * bs], j)
                ids.extend(range(parent - (j - i) + 1, parent + 1))
                i = j
                continue
            block_tokens = bytes(packed[i * width : (i + 1) * width])
            if existing is held[i]:
                parent = existing.cache_id
            elif (
                existing.token_ids == block_tokens
                and (existing.parent_cache_id == parent or not chained)
                and existing.extra == (other_extra if i else first_extra)
            ) or not verify:
                pool.touch((existing,))
                seq.merges.append((group_id, i, existing))
                parent = existing.cache_id
            else:
                # A collision: this content cannot be indexed, nor anything chained to it.
                seq.cache_chain_broken = True
                break
            ids.append(parent)
            i += 1
        return ids


class SlidingWindowGroup(FullAttentionGroup):
    """Sliding window W: only the blocks holding the last W-1 keys must be present.

    Blocks wholly before the window are released while the request runs (the
    null block takes their place in the table; they stay cached until
    evicted), and a hit at position c needs only the blocks covering
    [c - W + 1, c).
    """

    __slots__ = ("window",)

    kind = "sliding_window"

    def __init__(
        self, group_id: int, spec: SlidingWindowSpec, pool: BlockPool, verify: bool
    ) -> None:
        super().__init__(group_id, spec, pool, verify)
        self.window = spec.sliding_window

    def first_needed(self, num_tokens: int) -> int:
        """Index of the first block a token at position `num_tokens` still reads."""
        first_key = num_tokens - self.window + 1
        return first_key // self.block_size if first_key > 0 else 0

    def max_blocks_held(self, num_tokens: int, max_chunk_tokens: int | None) -> int:
        """Only the window plus the chunk being computed (when chunks are bounded)."""
        full = -(-num_tokens // self.block_size)
        if max_chunk_tokens is None:
            return full
        span = self.window - 1 + max_chunk_tokens
        return min(full, -(-span // self.block_size) + 1)

    def find_window_hit(
        self,
        seq: CacheSequence,
        start: int,
        candidate: int,
        anchors: list[KVBlock] | None,
    ) -> tuple[int, list[KVBlock]]:
        """Largest k <= candidate whose window blocks are cached; table entries [start, k)."""
        hashes = seq.block_hashes
        index_get = self.index.get
        bs = self.block_size
        tokens = seq.token_ids
        packed, width = seq.packed_through(candidate, bs), 4 * bs
        first_extra, other_extra = seq.extra_keys
        verify = self.verify
        null = self.pool.null_block
        found: dict[int, KVBlock | None] = {}

        def lookup(i: int) -> KVBlock | None:
            if i in found:
                return found[i]
            block = index_get(hashes[i])
            if block is not None and verify:
                anchor = (
                    anchors[i - start] if anchors is not None and i - start < len(anchors) else None
                )
                if (
                    (
                        anchors is not None
                        and (anchor is None or block.parent_cache_id != anchor.cache_id)
                    )
                    or block.token_ids != bytes(packed[i * width : (i + 1) * width])
                    or block.extra != (other_extra if i else first_extra)
                ):
                    block = None
            found[i] = block
            return block

        k = candidate
        while k > start:
            # A hit covering every token recomputes the last one (at len - 1, its
            # write skipped): its window, and the block holding it, must be there.
            lo = max(start, self.first_needed(min(k * bs, len(tokens) - 1)))
            window: list[KVBlock] = []  # blocks k-1, k-2, ..., lo
            for i in range(k - 1, lo - 1, -1):
                block = lookup(i)
                if block is None:
                    k = i
                    break
                window.append(block)
            else:
                blocks = [null] * (lo - start)
                blocks.extend(reversed(window))
                return k, blocks
        return start, []

    def num_new_blocks(
        self, seq: CacheSequence, num_tokens: int, num_hit: int, first: int = 0
    ) -> int:
        """Blocks to take so `num_tokens` tokens have slots; those wholly before the
        window of position `first` (the first one the step computes) are not needed."""
        have = max(len(seq.kv_blocks[self.group_id]) + num_hit, self.first_needed(first))
        return -(-num_tokens // self.block_size) - have

    def pad_window(self, seq: CacheSequence, first: int) -> None:
        """The null block for the entries before `first`'s window that the table lacks
        (tokens loaded from an external tier that no computed token reads)."""
        table = seq.kv_blocks[self.group_id]
        missing = self.first_needed(first) - len(table)
        if missing > 0:
            table.extend([self.pool.null_block] * missing)

    def remove_skipped(self, seq: CacheSequence, num_computed_tokens: int) -> None:
        """Release blocks no token from `num_computed_tokens` on will read."""
        table = seq.kv_blocks[self.group_id]
        end = min(self.first_needed(num_computed_tokens), len(table))
        null = self.pool.null_block
        i = seq.num_skipped_blocks[self.group_id]
        if i >= end:
            return
        released = []
        for j in range(i, end):
            if table[j] is not null:
                released.append(table[j])
                table[j] = null
        seq.num_skipped_blocks[self.group_id] = end
        seq.table_changed(self.group_id)
        self.pool.release(reversed(released))

    def cache_full_blocks(
        self, seq: CacheSequence, start: int, end: int, anchors: list[int] | None = None
    ) -> list[int]:
        """Register like full attention, each block anchored to the full-attention block.

        Entries that are the null block (tokens loaded from an external tier before
        the window of the first computed token) hold nothing: never registered.
        """
        table = seq.kv_blocks[self.group_id]
        null = self.pool.null_block
        skip = start
        while skip < end and table[skip] is null:
            skip += 1
        if anchors is None:
            # Windows alone: the block before may be gone (released out of the window),
            # so no parent is checked, here as in find_window_hit.
            parent = self._parent_of(seq, skip) or ROOT_CACHE_ID
            self._register(seq, skip, end, None, parent, chained=False)
            return []
        end = start + len(anchors)
        return self._register(seq, skip, end, anchors[skip - start :], ROOT_CACHE_ID)


def attention_group(
    group_id: int, spec: KVCacheSpec, pool: BlockPool, verify: bool
) -> FullAttentionGroup:
    """The group manager for one attention spec (Mamba state groups: state_coordinator)."""
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowGroup(group_id, spec, pool, verify)
    if isinstance(spec, FullAttentionSpec):
        return FullAttentionGroup(group_id, spec, pool, verify)
    raise ValueError(f"no attention group for {type(spec).__name__}")
