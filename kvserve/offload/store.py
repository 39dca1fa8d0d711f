"""Stacked tiers: CPU memory in front of disk, written through, read front first.

A put goes to every tier: the CPU tier at once, slower tiers from a
background thread (the engine never waits for a disk write). A write that
does not land (the queue is full, the disk is read-only or full, the block
is larger than the tier) is dropped and counted, never retried: it is only a
cache. The first drop of each cause is logged, the others only counted; the
bytes saved count only blocks that landed. A get is
answered by the fastest tier that has the key; it is not copied forward,
so each tier holds exactly what was offered to it with its request, and a
listener (the KV events) hears what each tier stores and evicts.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from typing import Any, Protocol

from kvserve.offload.disk_tier import DiskTier
from kvserve.offload.tiers import Tier

logger = logging.getLogger(__name__)


class TierListener(Protocol):
    def tier_stored(self, medium: str, key: bytes, seq: Any, index: int) -> None: ...

    def tier_removed(self, medium: str, keys: list[bytes]) -> None: ...


class TierStack:
    """The tiers in order, fastest first."""

    def __init__(self, tiers: list[Tier], max_queued_writes: int = 1024) -> None:
        if not tiers:
            raise ValueError("an offload store needs at least one tier")
        self.tiers = tiers
        self.listener: TierListener | None = None
        self.dropped_writes = 0
        """Writes to a tier that did not land (each tier a block was offered to counts)."""
        self.dropped_by_medium = dict.fromkeys((t.medium for t in tiers), 0)
        """The same drops by tier medium ("CPU", "STORAGE"): what /metrics exports."""
        self.bytes_saved = 0
        """Payload bytes of the blocks that landed in at least one tier."""
        self._lock = threading.Lock()
        self._counts_lock = threading.Lock()
        """For the counters only: the engine thread never waits on a disk write for them."""
        self._causes: set[tuple[str, str]] = set()
        """(tier, cause) of the drops logged so far: each cause is logged once."""
        # Memory tiers are written at once; the rest (disk) from a background thread.
        self._now = [t for t in tiers if t.medium == "CPU"]
        self._later = [t for t in tiers if t.medium != "CPU" and not getattr(t, "read_only", 0)]
        self.closers: list[Any] = []
        """Called at close (a transfer server over these tiers: kvserve.transfer)."""
        self._queue: queue.Queue[tuple | None] = queue.Queue(max_queued_writes)
        self._writer: threading.Thread | None = None
        if self._later:
            self._writer = threading.Thread(
                target=self._write_loop, name="kvserve-offload", daemon=True
            )
            self._writer.start()

    def contains(self, key: bytes, remote: bool = True) -> bool:
        """Whether a tier holds `key` (`remote` False: this engine's own tiers only)."""
        return any(
            tier.contains(key)
            for tier in self.tiers
            if remote or not getattr(tier, "read_only", False)
        )

    @property
    def writable(self) -> bool:
        """Whether a put can land anywhere (a consumer may have only a producer's tier)."""
        return bool(self._now or self._later)

    def get(self, key: bytes) -> bytes | None:
        for tier in self.tiers:
            data = tier.get(key)
            if data is not None:
                return data
        return None

    def contains_many(self, keys: Sequence[bytes], remote: bool = True) -> list[bool]:
        """`contains` of each key; a tier that can answer a batch at once (a producer's,
        over the network: one round trip) is asked once for the keys still missing.
        `remote` False: this engine's own tiers only (what a producer serves)."""
        return self._many("contains", keys, remote, False)

    def get_many(self, keys: Sequence[bytes], remote: bool = True) -> list[bytes | None]:
        """`get` of each key, each tier asked once for the keys still missing."""
        return self._many("get", keys, remote, None)

    def _many(self, op: str, keys: Sequence[bytes], remote: bool, miss: Any) -> list[Any]:
        out = [miss] * len(keys)
        missing = list(range(len(keys)))
        for tier in self.tiers:
            if not missing:
                break
            if getattr(tier, "read_only", False) and not remote:
                continue
            batch = getattr(tier, f"{op}_many", None)
            one = getattr(tier, op)
            asked = [keys[i] for i in missing]
            found = batch(asked) if batch is not None else [one(k) for k in asked]
            for i, value in zip(missing, found, strict=True):
                out[i] = value
            missing = [i for i in missing if out[i] in (None, False)]
        return out

    def hold(self, keys: Sequence[bytes]) -> None:
        """Keep `keys` for one more request in the tiers that keep blocks (a producer's
        CPU tier: kvserve.offload.cpu_tier); the others ignore it."""
        for tier in self._now:
            hold = getattr(tier, "hold", None)
            if hold is not None:
                hold(keys)

    def release(self, keys: Sequence[bytes]) -> None:
        """A consumer pulled `keys`: one hold of each ends."""
        for tier in self._now:
            release = getattr(tier, "release", None)
            if release is not None:
                release(keys)

    def hold_counts(self) -> dict[str, int]:
        """The keeping tiers' blocks held now and holds ended, by why (summed)."""
        total: dict[str, int] = {}
        for tier in self._now:
            counts = getattr(tier, "hold_counts", None)
            for name, value in (counts() if counts is not None else {}).items():
                total[name] = total.get(name, 0) + value
        return total

    def put(
        self, key: bytes, data: bytes, seq: Any = None, index: int = -1, keep: bool = False
    ) -> None:
        """Store in the memory tiers now and in the others from the background thread;
        `keep`: held at once in the tiers that keep blocks (`hold`)."""
        landed = [self._put_into(tier, key, data, seq, index, keep) for tier in self._now]
        if any(landed):
            self._saved(len(data))
        if self._writer is None:
            return
        try:
            self._queue.put_nowait((key, data, seq, index, any(landed)))
        except queue.Full:
            for tier in self._later:
                self._drop(tier, "queue", "the queue of writes waiting for it is full")

    def _put_into(
        self, tier: Tier, key: bytes, data: bytes, seq: Any, index: int, keep: bool = False
    ) -> bool:
        """Whether the block landed in `tier` (a drop is counted, its cause logged once)."""
        size = tier.stored_size(len(key), len(data))
        if size > tier.capacity:
            self._drop(tier, "size", f"a {size}-byte block is larger than the whole tier")
            return False
        try:
            with self._lock:
                known = tier.contains(key)
                evicted = tier.put(key, data)
                hold = getattr(tier, "hold", None) if keep else None
                if hold is not None:
                    hold([key])
                listener = self.listener
                if listener is not None:
                    if evicted:
                        listener.tier_removed(tier.medium, evicted)
                    if not known and seq is not None and tier.contains(key):
                        listener.tier_stored(tier.medium, key, seq, index)
        except OSError as exc:  # a read-only or full disk must not stop the engine
            reason = (exc.strerror or str(exc)).lower()
            self._drop(tier, f"errno {exc.errno}", f"writing failed: {reason}")
            return False
        return True

    def _saved(self, size: int) -> None:
        with self._counts_lock:
            self.bytes_saved += size

    def _drop(self, tier: Tier, cause: str, detail: str) -> None:
        name = f"disk tier {tier.path}" if isinstance(tier, DiskTier) else f"{tier.medium} tier"
        with self._counts_lock:
            self.dropped_writes += 1
            self.dropped_by_medium[tier.medium] += 1
            first = (name, cause) not in self._causes
            self._causes.add((name, cause))
        if first:
            logger.warning(
                "offload: a KV block was not stored in the %s: %s (further writes dropped "
                "for this reason are counted in offload_dropped_writes, not logged)",
                name,
                detail,
            )

    def _write_loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                key, data, seq, index, counted = job
                landed = [self._put_into(tier, key, data, seq, index) for tier in self._later]
                if any(landed) and not counted:
                    self._saved(len(data))
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued write is done."""
        if self._writer is not None:
            self._queue.join()

    def close(self) -> None:
        for closer in self.closers:
            closer()
        self.closers.clear()
        if self._writer is not None and self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
