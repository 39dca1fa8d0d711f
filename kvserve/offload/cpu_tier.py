"""CPU tier: KV blocks in host memory, evicted least recently used first.

A KV transfer producer's tier also *keeps* blocks (`hold_seconds` > 0): a block written
for a request (`hold`) is held, not evictable, until a consumer's pull has covered it
(`release`), or its deadline passes, so memory pressure from the next prompts does not
evict it before the decode engine pulls it. Holds never make the tier unbounded or stall
a put: when only held blocks are left to evict, the oldest hold is released and its block
evicted (the consumer then recomputes it). A block held for several requests (a shared
prefix) is released after as many pulls. The tier owns this state; the counters say why
each hold ended (`hold_counts`).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True)
class _Kept:
    payload: bytes
    deadline: float
    holds: int
    """Requests it is held for (each pull releases one)."""


class CpuTier:
    """An LRU dict of payloads whose total size never exceeds `capacity` bytes.

    `used_bytes` counts payload bytes only (keys and dict overhead are small next to a
    KV block). One lock guards every method: the connector puts from its own thread and
    a producer's block server releases from its own.
    """

    medium = "CPU"
    __slots__ = (
        "_blocks",
        "_kept",
        "_lock",
        "capacity",
        "hold_seconds",
        "released",
        "used_bytes",
    )

    def __init__(self, capacity: int, hold_seconds: float = 0.0) -> None:
        if capacity <= 0:
            raise ValueError(f"cpu tier capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.hold_seconds = hold_seconds
        """How long a `hold` keeps a block unevictable unless pulled; 0: plain LRU."""
        self.used_bytes = 0
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()  # not held, LRU first
        self._kept: OrderedDict[bytes, _Kept] = OrderedDict()  # held, oldest hold first
        self.released = {"pull": 0, "deadline": 0, "pressure": 0}
        """Blocks whose hold ended, by why."""
        self._lock = threading.Lock()

    @staticmethod
    def stored_size(key_bytes: int, payload_bytes: int) -> int:
        """What one block counts against the capacity: its payload."""
        return payload_bytes

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._blocks or key in self._kept

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None:
                return kept.payload
            payload = self._blocks.get(key)
            if payload is not None:
                self._blocks.move_to_end(key)
            return payload

    def put(self, key: bytes, payload: bytes) -> list[bytes]:
        # A memoryview or bytearray may alias a buffer the caller reuses: keep our own copy.
        data = payload if type(payload) is bytes else bytes(payload)
        size = len(data)
        if size > self.capacity:
            return []
        evicted: list[bytes] = []
        with self._lock:
            now = time.monotonic()
            self._expire(now)
            kept = self._kept.pop(key, None)  # new bytes for a held block: held anew
            old = kept.payload if kept is not None else self._blocks.pop(key, None)
            if old is not None:
                self.used_bytes -= len(old)
            while self.used_bytes + size > self.capacity:
                if self._blocks:
                    victim, victim_data = self._blocks.popitem(last=False)
                else:  # only held blocks are left: the oldest hold gives way
                    victim, oldest = self._kept.popitem(last=False)
                    victim_data = oldest.payload
                    self.released["pressure"] += 1
                self.used_bytes -= len(victim_data)
                evicted.append(victim)
            if kept is not None:
                self._kept[key] = _Kept(data, now + self.hold_seconds, kept.holds)
            else:
                self._blocks[key] = data
            self.used_bytes += size
        return evicted

    def hold(self, keys: Iterable[bytes]) -> None:
        """Keep the present `keys` for one more request, each until a pull releases it or
        `hold_seconds` pass (the deadline renewed); absent keys are skipped."""
        if self.hold_seconds <= 0:
            return
        with self._lock:
            now = time.monotonic()
            for key in keys:
                kept = self._kept.pop(key, None)
                if kept is None:
                    payload = self._blocks.pop(key, None)
                    if payload is None:
                        continue
                    kept = _Kept(payload, 0.0, 0)
                kept.deadline = now + self.hold_seconds
                kept.holds += 1
                self._kept[key] = kept  # the newest hold: the last to give way
            self._expire(now)

    def release(self, keys: Iterable[bytes]) -> None:
        """A consumer pulled `keys`: one hold of each ends (a block whose last hold ended
        is evictable again, as recently used)."""
        with self._lock:
            for key in keys:
                kept = self._kept.get(key)
                if kept is None:
                    continue
                kept.holds -= 1
                if kept.holds <= 0:
                    del self._kept[key]
                    self._blocks[key] = kept.payload
                    self.released["pull"] += 1
            self._expire(time.monotonic())

    def _expire(self, now: float) -> None:
        """End the holds whose deadline passed (under the lock): every hold lasts
        `hold_seconds`, so the oldest are due first. Their blocks, which nobody pulled,
        become the first evicted (the oldest first)."""
        due: list[tuple[bytes, bytes]] = []
        while self._kept:
            key, kept = next(iter(self._kept.items()))
            if kept.deadline > now:
                break
            del self._kept[key]
            due.append((key, kept.payload))
        for key, payload in reversed(due):
            self._blocks[key] = payload
            self._blocks.move_to_end(key, last=False)
        self.released["deadline"] += len(due)

    def hold_counts(self) -> dict[str, int]:
        """Blocks held now (`kept_blocks`), and those whose hold ended, by why."""
        with self._lock:
            self._expire(time.monotonic())
            counts = {f"kept_released_by_{why}": n for why, n in self.released.items()}
            return {"kept_blocks": len(self._kept), **counts}

    def keys(self) -> list[bytes]:
        with self._lock:
            return [*self._blocks, *self._kept]
