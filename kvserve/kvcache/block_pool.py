"""The pool of physical blocks: free queue, ref counts and the prefix index."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvserve.kvcache.block import CacheEntry, KVBlock

if TYPE_CHECKING:
    from kvserve.kvcache.event_sink import KVEventSink


class NoFreeBlocksError(RuntimeError):
    """Raised when more blocks are taken than are free; callers check first."""


class BlockPool:
    """Fixed set of blocks shared by every group.

    Free blocks wait in one queue, in two parts. At the front, blocks that
    hold nothing reusable (a list used as a stack: the last one freed is the
    next one handed out, and a run of them is handed out in one slice): they
    are the cheapest to give away. Behind them, cached free blocks in LRU
    order (an OrderedDict: O(1) pop from the front, append, and removal from
    the middle when a freed cached block gets a hit). A freed block keeps its
    index entry until it is handed out again (lazy eviction), so a later
    request can still hit it. Block 0 is the null block and is never handed out.
    """

    __slots__ = (
        "_empty",
        "_epoch",
        "_free",
        "_holders",
        "_next_cache_id",
        "blocks",
        "events",
        "index",
        "num_evictions",
        "pending",
    )

    def __init__(self, num_blocks: int, num_groups: int = 1) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}"
            )
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._empty: list[KVBlock] = self.blocks[:0:-1]
        """Free blocks holding nothing reusable; the last is the front of the queue."""
        self._free: OrderedDict[int, KVBlock] = OrderedDict()
        """Free cached blocks, least recently used first (behind the empty ones)."""
        self.index: list[dict[bytes, KVBlock | CacheEntry]] = [{} for _ in range(num_groups)]
        """Per group: hash -> cached block; a group's index holds KVBlocks only, or
        CacheEntries only in inflated attention groups (each group casts its own)."""
        self.pending: list[KVBlock | CacheEntry] = []
        self._next_cache_id = 1
        self.num_evictions = 0
        self.events: KVEventSink | None = None
        """Event recorder (kvcache.event_sink); None when events are off."""
        self._epoch = [0] * num_blocks
        """Per block: how often it was handed out (a copy taken in an older epoch is gone)."""
        self._holders: dict[int, list[tuple[KVBlock, int]]] = {}
        """Inflated groups: entry cache_id -> (block, epoch) of other blocks holding a copy
        of its hash block at the same slot (see add_holder)."""

    @property
    def null_block(self) -> KVBlock:
        return self.blocks[0]

    @property
    def num_usable(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_free(self) -> int:
        return len(self._empty) + len(self._free)

    @property
    def num_used(self) -> int:
        return len(self.blocks) - 1 - len(self._empty) - len(self._free)

    def free_block_ids(self) -> list[int]:
        """Block ids in eviction order (front first)."""
        return [b.block_id for b in reversed(self._empty)] + list(self._free)

    def take(self, n: int) -> list[KVBlock]:
        """Hand out `n` blocks from the front of the queue, evicting their entries."""
        empty = self._empty
        free = self._free
        if n > len(empty) + len(free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(empty) + len(free)} free")
        epoch = self._epoch
        cut = max(0, len(empty) - n)
        out = empty[cut:]
        del empty[cut:]
        out.reverse()
        for block in out:
            epoch[block.block_id] += 1
            block.ref_cnt = 1
            if block.entries:  # inflated: an entry moved into it after it was freed
                self.num_evictions += self._uncache_entries(block, block.entries)
        popitem = free.popitem
        for _ in range(n - len(out)):
            block = popitem(last=False)[1]
            epoch[block.block_id] += 1
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVBlock) -> None:
        """A block is handed out again: whatever it cached leaves the index."""
        if block.block_hash is not None:
            if self.events is not None:
                self.events.removed(block.block_hash, block.group)
            self._uncache(block)
            self.num_evictions += 1
        elif block.entries:
            self.num_evictions += self._uncache_entries(block, block.entries)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference; a free block leaves the queue (its content is kept)."""
        free = self._free
        for block in blocks:
            if block.ref_cnt == 0 and free.pop(block.block_id, None) is None:
                self._empty.remove(block)  # rare: hits and merges touch cached blocks
            block.ref_cnt += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a reference; pass a request's blocks tail first (evicted first)."""
        free = self._free
        empty = self._empty
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None and not block.entries:
                    empty.append(block)
                else:
                    free[block.block_id] = block

    def register_run(
        self,
        group: int,
        blocks: list[KVBlock],
        hashes: list[bytes],
        token_ids: bytes,
        first_extra: bytes,
        extra: bytes,
        parent_cache_id: int,
    ) -> int:
        """Index consecutive blocks of one request under `hashes`, pending until the
        step ends, up to the first hash the index already holds (another block's, or an
        earlier one of this run's: only a collision repeats one); each is chained to the
        one before it (the first to `parent_cache_id`). `token_ids` covers the run; the
        first block's extra keys are `first_extra`, the others' `extra`. Returns how many
        were indexed: the caller handles the block that stopped the run.

        One probe a block: inserting with setdefault is also the check, where a check of
        the whole run first, then an update, probed the index twice (on long prompts the
        index outgrows the caches, and a probe is a cache miss)."""
        width = len(token_ids) // len(blocks)
        insert = self.index[group].setdefault
        parent = parent_cache_id
        first = cache_id = self._next_cache_id
        for block, block_hash, at in zip(
            blocks, hashes, range(0, len(token_ids), width), strict=True
        ):
            if insert(block_hash, block) is not block:
                break
            block.block_hash = block_hash
            block.group = group
            block.token_ids = token_ids[at : at + width]
            block.extra = extra
            block.parent_cache_id = parent
            block.cache_id = parent = cache_id
            cache_id += 1
        count = cache_id - first  # computed stays False until end_step
        if count:
            blocks[0].extra = first_extra
            self.pending.extend(blocks[:count])
        self._next_cache_id = cache_id
        return count

    def register_entry(
        self,
        group: int,
        block: KVBlock,
        slot: int,
        block_hash: bytes,
        token_ids: bytes,
        extra: bytes,
        parent_cache_id: int,
    ) -> CacheEntry:
        """Index hash block `slot` of an inflated `block`; pending until the step ends."""
        entry = CacheEntry(
            block, slot, block_hash, group, token_ids, extra, parent_cache_id, self._next_cache_id
        )
        self._next_cache_id += 1
        if block.entries is None:
            block.entries = [entry]
        else:
            block.entries.append(entry)
        self.pending.append(entry)
        self.index[group][block_hash] = entry
        return entry

    def uncache(self, block: KVBlock) -> None:
        """Drop a free block's index entry now (a state snapshot over its share).

        The block moves to the front of the queue: it holds nothing reusable.
        """
        block_hash = block.block_hash
        assert block_hash is not None, "uncache() takes a cached block"
        if self.events is not None:
            self.events.removed(block_hash, block.group)
        self._uncache(block)
        self.num_evictions += 1
        if block.ref_cnt == 0:
            del self._free[block.block_id]
            self._empty.append(block)

    def add_holder(self, entry: CacheEntry, block: KVBlock) -> None:
        """`block` holds a copy of `entry`'s hash block at `entry.slot` (copied into it,
        or computed again there), good until `block` is handed out again.

        When the entry's own block is reused, the entry moves to such a copy
        instead of leaving the index: hash blocks registered after it (in the
        copy's block, say) keep a live parent, and a full block whose hash
        blocks sit in several blocks stays findable (InflatedAttentionGroup).
        """
        epoch = self._epoch
        alive = [
            (b, e)
            for b, e in self._holders.get(entry.cache_id, ())
            if epoch[b.block_id] == e and b is not block
        ]
        alive.append((block, epoch[block.block_id]))
        self._holders[entry.cache_id] = alive

    def holds(self, block: KVBlock, entry: CacheEntry) -> bool:
        """Whether `block` holds `entry`'s hash block: its registered block, or a copy."""
        if entry.block is block:
            return True
        epoch = self._epoch[block.block_id]
        return any(b is block and e == epoch for b, e in self._holders.get(entry.cache_id, ()))

    def _uncache_entries(self, block: KVBlock, entries: list[CacheEntry]) -> int:
        """`block` is reused: each of its `entries` moves to a block holding its copy, or
        leaves the index. Returns how many left."""
        events = self.events
        epoch = self._epoch
        removed = 0
        for entry in entries:
            copies = [
                (b, e)
                for b, e in self._holders.pop(entry.cache_id, ())
                if epoch[b.block_id] == e and b is not block
            ]
            if copies:
                copy = copies.pop(0)[0]
                if copies:
                    self._holders[entry.cache_id] = copies
                entry.block = copy
                if copy.entries is None:
                    copy.entries = [entry]
                else:
                    copy.entries.append(entry)
                if entry.computed:  # the copy may be written by the step under way
                    entry.computed = False
                    self.pending.append(entry)
                continue
            if events is not None:
                events.removed(entry.block_hash, entry.group)
            del self.index[entry.group][entry.block_hash]
            entry.cache_id = 0
            removed += 1
        block.entries = None
        return removed

    def _uncache(self, block: KVBlock) -> None:
        block_hash = block.block_hash
        assert block_hash is not None, "only a cached block leaves the index"
        del self.index[block.group][block_hash]
        block.block_hash = None
        block.token_ids = None
        block.cache_id = 0
        block.computed = False

    def end_step(self) -> None:
        """The step ran: every pending block now holds its KV."""
        for block in self.pending:
            block.computed = True
        self.pending.clear()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any block is in use.

        Refusing keeps the rule simple for running requests and for event
        consumers: a reset is all or nothing, like vLLM's.
        """
        if self.num_used:
            return False
        events, self.events = self.events, None  # one AllBlocksCleared, no removals
        self._holders.clear()
        for block in self.blocks[1:]:
            if block.block_hash is not None:
                self._uncache(block)
            elif block.entries:
                self._uncache_entries(block, block.entries)
        self.events = events
        # Nothing reusable remains: every free block joins the empty ones, behind them.
        self._empty[:0] = reversed(self._free.values())
        self._free.clear()
        if self.events is not None:
            self.events.cleared()
        return True
