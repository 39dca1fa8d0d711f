"""The connector between the device pool and the external tiers.

Scheduler side: `lookup` finds how many tokens after the local prefix hit
the tiers can supply (for every group: attention hash blocks from the left,
and for state groups a snapshot exactly where the hit ends); the scheduler
then allocates them as external tokens after every group's local hits
(design.md invariant 4) and calls `on_allocated`. Worker side: `load` writes
the payloads into the new blocks before the step; `save` stores what the
step computed, after it. Keys are (group, block hash): block hashes are
deterministic across processes, so a restarted engine or another process
with the same model and directory finds what this one saved.

`lookup` asks the tiers about a request's whole run of blocks at once
(`contains_many`, then `get_many`): a producer's tier over the network
(kvserve.transfer) answers each in one round trip, not one per block, and a
block that is missing or fails its check ends the hit just before it.

The payloads a hit needs are read during `lookup` and kept until the
request is allocated, so a file that another process evicts (or that turns
out corrupt) in between costs a miss, never a load of missing data.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from kvserve.kvcache.plan import StatePlan, StepPlan
from kvserve.kvcache.specs import KVCacheSpec
from kvserve.offload.fetch import PENDING, Fetches
from kvserve.offload.store import TierStack


class BlockIO(Protocol):
    """The runner's side (kvserve.model.memory.kv_io.KVBlockIO)."""

    def read(self, group: int, block: int, offset: int = 0, num: int | None = None) -> bytes: ...

    def write(
        self, group: int, block: int, data: bytes, offset: int = 0, num: int | None = None
    ) -> None: ...


@dataclass(slots=True)
class OffloadStats:
    external_hit_tokens: int = 0
    bytes_loaded: int = 0
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


@dataclass(slots=True, frozen=True)
class _Group:
    group_id: int
    ratio: int
    """Hash blocks per physical block."""


class OffloadConnector:
    """Moves hash blocks and state snapshots between the pool and a TierStack.

    It reads the groups' specs, the request's block hashes and the step
    plans: plain data, never the KV cache manager's records.
    """

    def __init__(self, store: TierStack, specs: list[KVCacheSpec], hash_block_size: int) -> None:
        self.store = store
        self.hash_block_size = hash_block_size
        groups = [_Group(g, s.block_size // hash_block_size) for g, s in enumerate(specs)]
        self.attention = [g for g, s in zip(groups, specs, strict=True) if s.kind != "mamba"]
        self.states = [g for g, s in zip(groups, specs, strict=True) if s.kind == "mamba"]
        self.stats = OffloadStats()
        self._staged: dict[str, _Staged] = {}
        self._loads: list[_Load] = []
        self._saved: dict[str, _Saved] = {}
        remote = any(getattr(t, "read_only", False) for t in store.tiers)
        self.fetches = Fetches() if remote else None
        """Lookups that ask a producer run off the engine thread (fetch.py)."""

    # -- scheduler side -----------------------------------------------------------

    def lookup(
        self,
        request_id: str,
        num_tokens: int,
        block_hashes: Sequence[bytes],
        num_local_hit_tokens: int,
    ) -> int:
        """External hit tokens after the local hit (a multiple of the hash block); -1
        while a producer's answer is on its way (fetch.py: the request waits a step)."""
        hb = self.hash_block_size
        self._staged.pop(request_id, None)
        if num_local_hit_tokens % hb:
            return 0
        start = num_local_hit_tokens // hb
        if self.fetches is None:  # the tiers answer at once
            staged = self._find(num_tokens, block_hashes, start)
        else:
            hashes = list(block_hashes)
            answer = self.fetches.result(request_id, lambda: self._find(num_tokens, hashes, start))
            if answer is PENDING:
                return -1
            staged = _from(answer, start)  # the local hit may have grown meanwhile
        if staged is None:
            return 0
        self._staged[request_id] = staged
        return (staged.end - staged.start) * hb

    def wait_fetches(self, timeout: float = 0.05) -> None:
        """An engine with nothing to run waits here for a producer's answer."""
        if self.fetches is not None:
            self.fetches.wait(timeout)

    def _find(self, num_tokens: int, block_hashes: Sequence[bytes], start: int) -> _Staged | None:
        """The longest run from hash block `start` that the tiers hold, read (thread-safe:
        it only asks the tiers)."""
        hb = self.hash_block_size
        limit = min((num_tokens - 1) // hb, len(block_hashes))
        if limit <= start:
            return None
        # The whole run at once: a tier over the network answers it in one round trip.
        run = range(start, limit)
        keys = [block_key(g.group_id, block_hashes[i]) for i in run for g in self.attention]
        keys += [block_key(g.group_id, block_hashes[i]) for i in run for g in self.states]
        held = dict(zip(keys, self.store.contains_many(keys), strict=True))
        end = start
        while end < limit and all(
            held[block_key(g.group_id, block_hashes[end])] for g in self.attention
        ):
            end += 1
        fetched: dict[bytes, bytes | None] = {}
        while end > start:
            while end > start and not all(
                held[block_key(g.group_id, block_hashes[end - 1])] for g in self.states
            ):
                end -= 1
            if end == start:
                return None
            want = self._keys(block_hashes, start, end)
            new = [k for k in want if k not in fetched]
            fetched.update(zip(new, self.store.get_many(new), strict=True))
            staged = self._stage(block_hashes, start, end, fetched)
            if isinstance(staged, _Staged):
                return staged
            end = staged  # a payload went missing or failed its check: the run before it
            for k, data in fetched.items():
                held[k] = held[k] and data is not None
        return None

    def _keys(self, hashes: Sequence[bytes], start: int, end: int) -> list[bytes]:
        """What a hit of hash blocks [start, end) loads: every attention block, and each
        state group's snapshot where it ends."""
        keys = [block_key(g.group_id, hashes[i]) for i in range(start, end) for g in self.attention]
        return keys + [block_key(g.group_id, hashes[end - 1]) for g in self.states]

    def _stage(
        self, hashes: Sequence[bytes], start: int, end: int, fetched: dict[bytes, bytes | None]
    ) -> _Staged | int:
        """All payloads of [start, end), or the shorter end to retry with (the first block
        that is missing: what follows it cannot be used without it)."""
        blocks = []
        for i in range(start, end):
            row = []
            for g in self.attention:
                data = fetched[block_key(g.group_id, hashes[i])]
                if data is None:
                    return i
                row.append(data)
            blocks.append(row)
        states = []
        for g in self.states:
            data = fetched[block_key(g.group_id, hashes[end - 1])]
            if data is None:
                return end - 1
            states.append(data)
        return _Staged(start, end, blocks, states)

    def on_allocated(
        self, request_id: str, plan: StepPlan, num_local_hit_tokens: int, num_external: int
    ) -> None:
        """The request got blocks for its external tokens: plan their loads for this step."""
        if not num_external:
            return
        staged = self._staged.pop(request_id)
        hb = self.hash_block_size
        if (
            staged.start * hb != num_local_hit_tokens
            or (staged.end - staged.start) * hb != num_external
        ):
            raise RuntimeError(f"request {request_id}: allocation differs from its lookup")
        for i, row in zip(range(staged.start, staged.end), staged.blocks, strict=True):
            for g, data in zip(self.attention, row, strict=True):
                k = g.ratio
                block_id = plan.block_ids[g.group_id][i // k]
                if block_id:  # a sliding window may already have let it go
                    self._loads.append(_Load(g.group_id, block_id, (i % k) * hb, hb, data))
        for g, data in zip(self.states, staged.states, strict=True):
            running = plan.block_ids[g.group_id][0]
            self._loads.append(_Load(g.group_id, running, 0, None, data))
        self.stats.external_hit_tokens += num_external
        # What was loaded is in the tiers already: never saved again.
        saved = self._saved.setdefault(request_id, _Saved())
        saved.num_blocks = max(saved.num_blocks, staged.end)

    def request_finished(self, request_id: str) -> None:
        self._staged.pop(request_id, None)
        self._saved.pop(request_id, None)
        if self.fetches is not None:
            self.fetches.forget(request_id)

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

    def save(self, io: BlockIO, plan: StepPlan, record: Any) -> None:
        """Offer what a step computed for one request to the tiers (the store counts
        what lands: `TierStack.bytes_saved`).

        Full hash blocks of every attention group, and the state snapshots the
        step took (the plan's state plans). `record` has the request's
        `block_hashes`, `token_ids`, `lora_name` and `cache_salt` (plain data;
        the tiers' events describe the stored blocks with it) and
        `num_prompt_tokens` (what of it a consumer can pull, kept for it by a
        producer's tier until pulled).
        """
        full = plan.num_cacheable_blocks
        if not full or not self.store.writable:
            return
        t0 = time.perf_counter()
        hb = self.hash_block_size
        hashes = record.block_hashes
        start = plan.start
        saved = self._saved.get(plan.request_id)
        if saved is None:
            saved = self._saved[plan.request_id] = _Saved()
            known = min(start // hb, len(hashes))
        else:
            known = 0
        first = max(saved.num_blocks, start // hb)
        # What a consumer can pull of this prompt (its last token is always computed): each
        # attention block before that and the state where it ends. A producer's tier keeps
        # them until pulled (cpu_tier.py), those it held already (`known`) included, each
        # as it is offered (a later put must not evict it first).
        pullable = (record.num_prompt_tokens - 1) // hb
        if known:
            self.store.hold(
                [block_key(g.group_id, hashes[i]) for i in range(min(known, pullable))
                 for g in self.attention]
            )  # fmt: skip

        def offer(key: bytes, i: int, read: Callable[[], bytes], keep: bool) -> None:
            if self.store.contains(key, remote=False):  # this engine's tiers, not a peer's
                if keep:
                    self.store.hold([key])
                return
            self.store.put(key, read(), record, i, keep)

        for i in range(first, full):
            for g in self.attention:
                k = g.ratio
                block_id = plan.block_ids[g.group_id][i // k]
                if block_id:
                    read = partial(io.read, g.group_id, block_id, (i % k) * hb, hb)
                    offer(block_key(g.group_id, hashes[i]), i, read, i < pullable)
        saved.num_blocks = max(saved.num_blocks, full)
        state_plans: Sequence[StatePlan | None] = plan.state_plans or []
        for g in self.states:
            state = state_plans[g.group_id]
            for offset, page in state.snapshots if state is not None else ():
                i = (start + offset) // hb - 1
                read = partial(io.read, g.group_id, page)
                offer(block_key(g.group_id, hashes[i]), i, read, i == pullable - 1)
        self.stats.save_seconds += time.perf_counter() - t0

    def close(self) -> None:
        """Finish pending writes."""
        if self.fetches is not None:
            self.fetches.close()
        self.store.close()


def _from(staged: _Staged | None, start: int) -> _Staged | None:
    """The part of a run found earlier that follows a local hit ending at `start`."""
    if staged is None or not staged.start <= start < staged.end:
        return None
    if start == staged.start:
        return staged
    return _Staged(start, staged.end, staged.blocks[start - staged.start :], staged.states)
