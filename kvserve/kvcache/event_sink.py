"""Where the pool and the groups record events while a step runs.

The pool holds `events: KVEventSink | None`; with None (events disabled) the
hot path pays one attribute test and allocates nothing. Registration calls
`stored` once per newly cached hash block; consecutive blocks of one request
and group registered in one run coalesce into one `BlockStored`, with
`parent_block_hash` and `token_ids` lined up with `block_hashes`.

Hybrid state models go through the same two calls: an inflated attention
block registers each of its hash blocks (`stored` per hash block, `removed`
per CacheEntry when the physical block is evicted), and a state snapshot is
`stored` under the hash of the hash block it follows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvserve.kvcache.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    wire_hash,
)

if TYPE_CHECKING:
    pass


class HashedSequence(Protocol):
    """What an event needs of a request: its block hashes and extra keys.

    The manager's CacheSequence has these; the offload connector passes its
    own plain record of a request whose blocks it stored.
    """

    @property
    def block_hashes(self) -> Sequence[bytes]: ...
    @property
    def lora_name(self) -> str | None: ...
    @property
    def cache_salt(self) -> str | None: ...


def block_extra_keys(seq: HashedSequence, i: int) -> tuple[Any, ...] | None:
    """The extra keys hashed into block `i`: the LoRA name, and the cache salt (block 0)."""
    keys = []
    if seq.lora_name is not None:
        keys.append(seq.lora_name)
    if i == 0 and seq.cache_salt is not None:
        keys.append(seq.cache_salt)
    return tuple(keys) if keys else None


@dataclass(slots=True)
class KVEventSink:
    """Collects one step's events; `take()` hands them over and starts afresh.

    `KVCacheManager.attach_events(sink)` makes a manager record into it.
    """

    hash_block_size: int
    int_block_hashes: bool = True
    medium: str = MEDIUM_GPU
    group_kinds: list[tuple[str, int | None]] = field(default_factory=list)
    """Per group: (kv_cache_spec_kind, sliding window or None)."""
    events: list[KVEvent] = field(default_factory=list)
    _run: BlockStored | None = None
    _run_seq: HashedSequence | None = None
    _run_group: int = -1
    _run_next: int = -1

    def stored(
        self,
        group_id: int,
        seq: HashedSequence,
        i: int,
        token_ids: Sequence[int],
        end: int | None = None,
    ) -> None:
        """Hash blocks `i..end-1` of `seq` (just block `i` without `end`) were just
        registered in group `group_id`; `token_ids` are theirs, in order."""
        end = i + 1 if end is None else end
        wire = self.int_block_hashes
        hashes = [wire_hash(h, wire) for h in seq.block_hashes[i:end]]
        run = self._run
        if (
            run is not None
            and self._run_seq is seq
            and self._run_group == group_id
            and self._run_next == i
            and self.events
            and self.events[-1] is run
        ):
            run.block_hashes.extend(hashes)
            run.token_ids.extend(token_ids)
            if run.extra_keys is not None:
                run.extra_keys.extend(block_extra_keys(seq, k) for k in range(i, end))
            self._run_next = end
            return
        parent = wire_hash(seq.block_hashes[i - 1], wire) if i else None
        kind, window = self.group_kinds[group_id]
        run = BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=list(token_ids),
            block_size=self.hash_block_size,
            lora_id=None,
            medium=self.medium,
            lora_name=seq.lora_name,
            extra_keys=None
            if seq.lora_name is None and seq.cache_salt is None
            else [block_extra_keys(seq, k) for k in range(i, end)],
            group_idx=group_id,
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=window,
        )
        self.events.append(run)
        self._run, self._run_seq, self._run_group, self._run_next = run, seq, group_id, end

    def removed(self, block_hash: bytes, group_id: int) -> None:
        """A cached block, or one hash block of an inflated block, loses its index entry."""
        self.events.append(
            BlockRemoved(
                block_hashes=[wire_hash(block_hash, self.int_block_hashes)],
                medium=self.medium,
                group_idx=group_id,
            )
        )

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        """This step's events, in order; the sink is empty afterwards."""
        events = self.events
        self.events = []
        self._run = self._run_seq = None
        return events
