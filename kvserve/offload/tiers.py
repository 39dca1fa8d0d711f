"""The storage-tier interface the offload connector moves K/V bytes through.

A tier is a byte store keyed by short opaque keys (the connector uses group id + block
hash). Tiers know nothing about tensors or the engine: bytes in, bytes out. Every method is
thread-safe, because the connector stores from a background thread while the engine thread
looks blocks up. A tier may also answer a batch (`contains_many`, `get_many`: a list in
the keys' order); TierStack uses them where present (a producer's tier over the network
answers a request's whole run in one round trip) and asks key by key otherwise.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from kvserve.offload.cpu_tier import CpuTier
from kvserve.offload.disk_tier import DiskTier

__all__ = ["CpuTier", "DiskTier", "Tier"]


@runtime_checkable
class Tier(Protocol):
    """A bounded LRU byte store; `put` reports what it evicted so events can follow."""

    @property
    def medium(self) -> str:
        """ "CPU" or "STORAGE": vLLM's event medium names."""
        ...

    @property
    def capacity(self) -> int:
        """Budget in bytes."""
        ...

    @property
    def used_bytes(self) -> int:
        """Bytes held now, as this tier accounts them (never above capacity after a put)."""
        ...

    @staticmethod
    def stored_size(key_bytes: int, payload_bytes: int) -> int:
        """What one block of this key and payload size counts against the capacity
        (a tier smaller than one block is refused at start)."""
        ...

    def contains(self, key: bytes) -> bool:
        """Cheap membership test: no LRU change, no I/O beyond a stat. A hint: get decides."""
        ...

    def get(self, key: bytes) -> bytes | None:
        """The payload, or None on a miss; a hit becomes the most recently used."""
        ...

    def put(self, key: bytes, payload: bytes) -> list[bytes]:
        """Store (replacing a present key); returns the keys evicted to make room.

        A payload that can never fit (larger than the capacity) is not stored: returns [].
        A write that fails (a disk tier's I/O) raises OSError; the caller counts it.
        """
        ...

    def keys(self) -> list[bytes]:
        """Keys held now, least recently used first (for resync snapshots)."""
        ...
