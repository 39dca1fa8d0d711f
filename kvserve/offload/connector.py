"""The connector between the device pool and the external tiers.

Scheduler side: `lookup` finds how many tokens after the local prefix hit
the tiers can supply (for every group: attention hash blocks from the left,
and for state groups a snapshot exactly where the hit ends); the scheduler
then allocates them as external tokens after every group's local hits
(DESIGN invariant 4) and calls `on_allocated`. Worker side: `load` writes
the payloads into the new blocks before the step; `save` stores what the
step computed, after it. Keys are (group, block hash): block hashes are
deterministic across processes, so a restarted engine or another process
with the same model and directory finds what this one saved.

The payloads a hit needs are read during `lookup` and kept until the
request is allocated, so a file that another process evicts (or that turns
out corrupt) in between costs a miss, never a load of missing data.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvserve.offload.store import TierStack

if TYPE_CHECKING:
    from kvserve.kvcache.manager import KVCacheManager
    from kvserve.kvcache.sequence import CacheSequence


class BlockIO(Protocol):
    """The runner's side (kvserve.model.kv_io.KVBlockIO)."""

    def read(self, group: int, block: int, offset: int = 0, num: int | None = None) -> bytes: ...

    def write(
        self, group: int, block: int, data: bytes, offset: int = 0, num: int | None = None
    ) -> None: ...


@dataclass(slots=True)
class OffloadStats:
    external_hit_tokens: int = 0
    bytes_loaded: int = 0
    bytes_saved: int = 0
    load_seconds: float = 0.0
    save_seconds: float = 0.0


@dataclass(slots=True)
class _Staged:
    """Payloads of one request's external hit, read at lookup."""

    start: int
    """First hash block (the local hit's end)."""
    end: int
    blocks: list[list[bytes]]
    """Per hash block in [start, end): the payload of each attention group."""
    states: list[bytes]
    """Per state group: the snapshot after hash block end - 1."""


@dataclass(slots=True)
class _Load:
    group: int
    block: int
    offset: int
    num: int | None
    data: bytes


@dataclass(slots=True)
class _Saved:
    """Per request: hash blocks already offered to the tiers (each saved once)."""

    num_blocks: int = 0
    snapshots: set[int] = field(default_factory=set)


def block_key(group: int, block_hash: bytes) -> bytes:
    return bytes((group,)) + block_hash


class OffloadConnector:
    """Moves hash blocks and state snapshots between the pool and a TierStack."""

    def __init__(self, store: TierStack, manager: KVCacheManager) -> None:
        self.store = store
        self.manager = manager
        self.hash_block_size = manager.block_size
        self.attention = [g for g in manager.groups if g.kind != "mamba"]
        self.states = [g for g in manager.groups if g.kind == "mamba"]
        self.stats = OffloadStats()
        self._staged: dict[str, _Staged] = {}
        self._loads: list[_Load] = []
        self._saved: dict[str, _Saved] = {}

    # -- scheduler side -----------------------------------------------------------

    def lookup(self, seq: CacheSequence, num_local_hit_tokens: int) -> int:
        """External hit tokens after the local hit (a multiple of the hash block)."""
        hb = self.hash_block_size
        self._staged.pop(seq.request_id, None)
        if not self.manager.enable_caching or num_local_hit_tokens % hb:
            return 0
        start = num_local_hit_tokens // hb
        limit = min((len(seq.token_ids) - 1) // hb, len(seq.block_hashes))
        contains = self.store.contains
        hashes = seq.block_hashes
        end = start
        while end < limit and all(
            contains(block_key(g.group_id, hashes[end])) for g in self.attention
        ):
            end += 1
        while end > start:
            if self.states:
                while end > start and not all(
                    contains(block_key(g.group_id, hashes[end - 1])) for g in self.states
                ):
                    end -= 1
                if end == start:
                    return 0
            staged = self._read(seq, start, end)
            if isinstance(staged, _Staged):
                self._staged[seq.request_id] = staged
                return (end - start) * hb
            end = staged  # a payload went missing: try shorter
        return 0

    def _read(self, seq: CacheSequence, start: int, end: int) -> _Staged | int:
        """All payloads of [start, end), or the shorter end to retry with."""
        get = self.store.get
        hashes = seq.block_hashes
        blocks = []
        for i in range(start, end):
            row = []
            for g in self.attention:
                data = get(block_key(g.group_id, hashes[i]))
                if data is None:
                    return i
                row.append(data)
            blocks.append(row)
        states = []
        for g in self.states:
            data = get(block_key(g.group_id, hashes[end - 1]))
            if data is None:
                return end - 1
            states.append(data)
        return _Staged(start, end, blocks, states)

    def on_allocated(
        self, seq: CacheSequence, num_local_hit_tokens: int, num_external: int
    ) -> None:
        """`seq` got blocks for its external tokens: plan their loads for this step."""
        if not num_external:
            return
        staged = self._staged.pop(seq.request_id)
        hb = self.hash_block_size
        if (
            staged.start * hb != num_local_hit_tokens
            or (staged.end - staged.start) * hb != num_external
        ):
            raise RuntimeError(f"request {seq.request_id}: allocation differs from its lookup")
        for i, row in zip(range(staged.start, staged.end), staged.blocks, strict=True):
            for g, data in zip(self.attention, row, strict=True):
                k = g.block_size // hb
                block = seq.kv_blocks[g.group_id][i // k]
                if block.block_id:  # a sliding window may already have let it go
                    self._loads.append(_Load(g.group_id, block.block_id, (i % k) * hb, hb, data))
        for g, data in zip(self.states, staged.states, strict=True):
            running = seq.kv_blocks[g.group_id][0]
            self._loads.append(_Load(g.group_id, running.block_id, 0, None, data))
        self.stats.external_hit_tokens += num_external
        # What was loaded is in the tiers already: never saved again.
        saved = self._saved.setdefault(seq.request_id, _Saved())
        saved.num_blocks = max(saved.num_blocks, staged.end)

    def request_finished(self, seq: CacheSequence) -> None:
        self._staged.pop(seq.request_id, None)
        self._saved.pop(seq.request_id, None)

    # -- worker side --------------------------------------------------------------

    def load(self, io: BlockIO) -> None:
        """Write this step's external payloads into their blocks (before the forward)."""
        if not self._loads:
            return
        t0 = time.perf_counter()
        for job in self._loads:
            io.write(job.group, job.block, job.data, job.offset, job.num)
            self.stats.bytes_loaded += len(job.data)
        self._loads.clear()
        self.stats.load_seconds += time.perf_counter() - t0

    def save(self, io: BlockIO, seq: CacheSequence, start: int, end: int, snapshots) -> None:
        """Offer what a step computed for `seq` (tokens [start, end)) to the tiers.

        Full hash blocks of every attention group, and the state snapshots the
        step took (`snapshots`: per state group, the plan's (offset, page) pairs).
        """
        if not self.manager.enable_caching or seq.cache_chain_broken:
            return
        t0 = time.perf_counter()
        hb = self.hash_block_size
        saved = self._saved.setdefault(seq.request_id, _Saved())
        full = min(end // hb, len(seq.block_hashes))
        first = max(saved.num_blocks, start // hb)
        contains = self.store.contains
        for i in range(first, full):
            for g in self.attention:
                key = block_key(g.group_id, seq.block_hashes[i])
                k = g.block_size // hb
                block = seq.kv_blocks[g.group_id][i // k]
                if not block.block_id or contains(key):
                    continue
                data = io.read(g.group_id, block.block_id, (i % k) * hb, hb)
                self.store.put(key, data, seq, i)
                self.stats.bytes_saved += len(data)
        saved.num_blocks = max(saved.num_blocks, full)
        for g, pairs in zip(self.states, snapshots, strict=True):
            for offset, page in pairs:
                i = (start + offset) // hb - 1
                key = block_key(g.group_id, seq.block_hashes[i])
                if contains(key):
                    continue
                data = io.read(g.group_id, page)
                self.store.put(key, data, seq, i)
                self.stats.bytes_saved += len(data)
        self.stats.save_seconds += time.perf_counter() - t0

    def close(self) -> None:
        """Finish pending writes."""
        self.store.close()
