"""The pool of physical blocks: free queue, ref counts and the prefix index."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvserve.kvcache.block import KVBlock
from kvserve.kvcache.cache_entry import CacheEntry

if TYPE_CHECKING:
    from kvserve.kvcache.event_sink import KVEventSink


class NoFreeBlocksError(RuntimeError):
    """Raised when more blocks are taken than are free; callers check first."""


class BlockPool:
    """Fixed set of blocks shared by every group.

    Free blocks wait in an LRU queue (an OrderedDict: O(1) pop from the front,
    append, and removal from the middle when a freed cached block gets a hit).
    A freed block keeps its index entry until it is handed out again (lazy
    eviction), so a later request can still hit it. Blocks that hold nothing
    reusable go to the front: they are the cheapest to give away. Block 0 is
    the null block and is never handed out.
    """

    __slots__ = (
        "_free",
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
        self._free: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[1:]
        )
        self.index: list[dict[bytes, KVBlock]] = [{} for _ in range(num_groups)]
        """Per group: hash -> cached block (a CacheEntry in inflated attention groups)."""
        self.pending: list[KVBlock | CacheEntry] = []
        self._next_cache_id = 1
        self.num_evictions = 0
        self.events: KVEventSink | None = None
        """Event recorder (kvcache.event_sink); None when events are off."""

    @property
    def null_block(self) -> KVBlock:
        return self.blocks[0]

    @property
    def num_usable(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self.blocks) - 1 - len(self._free)

    def free_block_ids(self) -> list[int]:
        """Block ids in eviction order (front first)."""
        return list(self._free)

    def take(self, n: int) -> list[KVBlock]:
        """Hand out `n` blocks from the front of the queue, evicting their entries."""
        free = self._free
        if n > len(free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(free)} free")
        popitem = free.popitem
        out = []
        for _ in range(n):
            block = popitem(last=False)[1]
            if block.block_hash is not None:
                if self.events is not None:
                    self.events.removed(block)
                self._uncache(block)
                self.num_evictions += 1
            elif block.entries:
                self.num_evictions += len(block.entries)
                self._uncache_entries(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference; a free block leaves the queue (its content is kept)."""
        free = self._free
        for block in blocks:
            if block.ref_cnt == 0:
                del free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a reference; pass a request's blocks tail first (evicted first)."""
        free = self._free
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                free[block.block_id] = block
                if block.block_hash is None and not block.entries:
                    free.move_to_end(block.block_id, last=False)

    def register(
        self,
        group: int,
        block: KVBlock,
        block_hash: bytes,
        token_ids: list[int],
        extra: bytes,
        parent_cache_id: int,
        computed: bool,
    ) -> None:
        """Put a block in its group's index under `block_hash`."""
        block.block_hash = block_hash
        block.group = group
        block.token_ids = token_ids
        block.extra = extra
        block.parent_cache_id = parent_cache_id
        block.cache_id = self._next_cache_id
        self._next_cache_id += 1
        block.computed = computed
        if not computed:
            self.pending.append(block)
        self.index[group][block_hash] = block

    def register_entry(
        self,
        group: int,
        block: KVBlock,
        slot: int,
        block_hash: bytes,
        token_ids: list[int],
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
        self.index[group][block_hash] = entry  # type: ignore[assignment]
        return entry

    def uncache(self, block: KVBlock) -> None:
        """Drop a free block's index entry now (a state snapshot over its share).

        The block moves to the front of the queue: it holds nothing reusable.
        """
        if self.events is not None:
            self.events.removed(block)
        self._uncache(block)
        self.num_evictions += 1
        if block.ref_cnt == 0:
            self._free.move_to_end(block.block_id, last=False)

    def _uncache_entries(self, block: KVBlock) -> None:
        events = self.events
        for entry in block.entries:  # type: ignore[union-attr]
            if events is not None:
                events.removed(entry)  # type: ignore[arg-type]
            del self.index[entry.group][entry.block_hash]
            entry.cache_id = 0
        block.entries = None

    def _uncache(self, block: KVBlock) -> None:
        del self.index[block.group][block.block_hash]
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
        for block in self.blocks[1:]:
            if block.block_hash is not None:
                self._uncache(block)
            elif block.entries:
                self._uncache_entries(block)
        self.events = events
        # Nothing reusable remains, so queue order no longer matters.
        if self.events is not None:
            self.events.cleared()
        return True
