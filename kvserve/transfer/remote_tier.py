"""The consumer's side: a producer's blocks as one more tier, read-only.

The offload connector looks blocks up tier by tier; this tier asks a producer
(server.py) over a ZMQ REQ socket. Whatever goes wrong (a producer gone or slow past
`timeout_s`, another fingerprint, a payload whose checksum does not match) is a miss:
the consumer computes that block itself. A producer that timed out is not asked again
for a few seconds, so a dead one costs one timeout, not one per block.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import msgspec
import xxhash
import zmq

log = logging.getLogger("kvserve.transfer")

BACKOFF_SECONDS = 5.0


class RemoteTier:
    """A producer's tiers, read through the network; never written."""

    medium = "REMOTE"
    read_only = True
    capacity = 0
    used_bytes = 0

    def __init__(self, endpoint: str, fingerprint: bytes, timeout_s: float) -> None:
        self.endpoint = endpoint
        self.fingerprint = fingerprint
        self.timeout_ms = int(timeout_s * 1000)
        self.context: zmq.Context[Any] = zmq.Context.instance()
        self.socket: Any = None
        self._lock = threading.Lock()
        self._down_until = 0.0
        self.blocks_received = 0
        self.bytes_received = 0
        self.rejected = 0
        """Payloads whose checksum did not match (recomputed instead)."""
        self.failures = 0
        """Asks that got no answer (gone, slow, another model's blocks): recomputed."""
        self.seconds = 0.0
        """Time spent asking."""

    @staticmethod
    def stored_size(key_bytes: int, payload_bytes: int) -> int:
        return 0

    def contains(self, key: bytes) -> bool:
        answer = self._ask("contains", [key])
        return bool(answer and answer[0])

    def get(self, key: bytes) -> bytes | None:
        answer = self._ask("get", [key])
        if not answer or answer[0] is None:
            return None
        data, checksum = answer[0]
        if xxhash.xxh64_intdigest(data) != checksum:
            self.rejected += 1
            log.warning(
                "KV transfer: a block from %s failed its checksum: recomputed", self.endpoint
            )
            return None
        self.blocks_received += 1
        self.bytes_received += len(data)
        return bytes(data)

    def put(self, key: bytes, payload: bytes) -> list[bytes]:
        return []  # the producer's tiers are its own

    def keys(self) -> list[bytes]:
        return []

    def _ask(self, op: str, keys: list[bytes]) -> list[Any] | None:
        with self._lock:
            if time.monotonic() < self._down_until:
                return None
            started = time.perf_counter()
            try:
                return self._ask_locked(op, keys)
            finally:
                self.seconds += time.perf_counter() - started

    def _ask_locked(self, op: str, keys: list[bytes]) -> list[Any] | None:
        """One round trip (the lock held); None on any failure."""
        if self.socket is None:
            self.socket = self.context.socket(zmq.REQ)
            self.socket.setsockopt(zmq.LINGER, 0)
            self.socket.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
            self.socket.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
            self.socket.connect(self.endpoint)
        try:
            self.socket.send(msgspec.msgpack.encode([op, self.fingerprint, keys]))
            status, value = msgspec.msgpack.decode(self.socket.recv())
        except zmq.ZMQError:  # gone or slow: a REQ socket that missed its reply is reset
            self.failures += 1
            self.socket.close()
            self.socket = None
            self._down_until = time.monotonic() + BACKOFF_SECONDS
            log.warning("KV transfer: %s did not answer: recomputing", self.endpoint)
            return None
        if status != "ok":
            self.failures += 1
            if status == "fingerprint":
                log.warning("KV transfer: %s holds another model's blocks", self.endpoint)
            self._down_until = time.monotonic() + BACKOFF_SECONDS
            return None
        return list(value)

    def close(self) -> None:
        with self._lock:
            if self.socket is not None:
                self.socket.close()
                self.socket = None
