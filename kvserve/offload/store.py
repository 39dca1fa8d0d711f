"""Stacked tiers: CPU memory in front of disk, written through, read front first.

A put goes to every tier: the CPU tier at once, slower tiers from a
background thread (the engine never waits for a disk write; when the queue
is full the write is dropped and counted, it is only a cache). A get is
answered by the fastest tier that has the key; it is not copied forward,
so each tier holds exactly what was offered to it with its request, and a
listener (the KV events) hears what each tier stores and evicts.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Protocol

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
        self._lock = threading.Lock()
        # Memory tiers are written at once; the rest (disk) from a background thread.
        self._now = [t for t in tiers if t.medium == "CPU"]
        self._later = [t for t in tiers if t.medium != "CPU"]
        self._queue: queue.Queue[tuple | None] = queue.Queue(max_queued_writes)
        self._writer: threading.Thread | None = None
        if self._later:
            self._writer = threading.Thread(
                target=self._write_loop, name="kvserve-offload", daemon=True
            )
            self._writer.start()

    def contains(self, key: bytes) -> bool:
        return any(tier.contains(key) for tier in self.tiers)

    def get(self, key: bytes) -> bytes | None:
        for tier in self.tiers:
            data = tier.get(key)
            if data is not None:
                return data
        return None

    def put(self, key: bytes, data: bytes, seq: Any = None, index: int = -1) -> None:
        """Store in the memory tiers now and in the others from the background thread."""
        for tier in self._now:
            self._put_into(tier, key, data, seq, index)
        if self._writer is None:
            return
        try:
            self._queue.put_nowait((key, data, seq, index))
        except queue.Full:
            self.dropped_writes += 1

    def _put_into(self, tier: Tier, key: bytes, data: bytes, seq: Any, index: int) -> None:
        with self._lock:
            known = tier.contains(key)
            evicted = tier.put(key, data)
            listener = self.listener
            if listener is None:
                return
            if evicted:
                listener.tier_removed(tier.medium, evicted)
            if not known and seq is not None and tier.contains(key):
                listener.tier_stored(tier.medium, key, seq, index)

    def _write_loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                key, data, seq, index = job
                for tier in self._later:
                    try:
                        self._put_into(tier, key, data, seq, index)
                    except OSError as exc:  # a full disk must not stop the engine
                        logger.warning("offload: writing to %s failed: %s", tier.medium, exc)
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued write is done."""
        if self._writer is not None:
            self._queue.join()

    def close(self) -> None:
        if self._writer is not None and self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
