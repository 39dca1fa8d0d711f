"""CPU tier: KV blocks in host memory, evicted least recently used first."""

from __future__ import annotations

import threading
from collections import OrderedDict


class CpuTier:
    """An LRU dict of payloads whose total size never exceeds `capacity` bytes.

    `used_bytes` counts payload bytes only (keys and dict overhead are small next to a
    KV block). One lock guards every method: the connector puts from its own thread.
    """

    medium = "CPU"
    __slots__ = ("_blocks", "_lock", "capacity", "used_bytes")

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"cpu tier capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.used_bytes = 0
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    @staticmethod
    def stored_size(key_bytes: int, payload_bytes: int) -> int:
        """What one block counts against the capacity: its payload."""
        return payload_bytes

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._blocks

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
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
            old = self._blocks.pop(key, None)
            if old is not None:
                self.used_bytes -= len(old)
            while self.used_bytes + size > self.capacity:
                victim, victim_data = self._blocks.popitem(last=False)
                self.used_bytes -= len(victim_data)
                evicted.append(victim)
            self._blocks[key] = data
            self.used_bytes += size
        return evicted

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._blocks)
